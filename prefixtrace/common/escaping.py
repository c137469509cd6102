"""Client text made safe for the places a person reads it: a terminal, an XML
file, a JSON island inside an HTML page.

Everything prefixtrace prints or writes can carry what a client sent (roles,
session ids, tool names, error texts), and a client is not trusted: an ANSI
escape must show as text instead of moving the cursor or retitling the
terminal, a control character must not make a JUnit file unparseable, and a
`</script>` inside recorded JSON must not end the script element that holds it.
(HTML text itself goes through `html.escape` at each interpolation.)
"""

from __future__ import annotations

import json
import re
from typing import Any

# C0 controls but tab and newline, DEL and the C1 controls (ESC starts ANSI
# sequences; 0x9b is an 8-bit CSI), the bidi embeddings/overrides/isolates that
# reorder what a terminal shows ("trojan source"), and lone surrogates.
_UNSAFE_FOR_TERMINAL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
                                  "\ud800-\udfff]")
# Not allowed anywhere in an XML 1.0 document (https://www.w3.org/TR/xml/#charsets).
_INVALID_XML = re.compile("[^\x09\x0a\x0d\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _escape(match: re.Match) -> str:
    return f"\\u{ord(match.group()):04x}"


def visible(text: str) -> str:
    """`text` with every character that a terminal would act on shown as `\\uXXXX`.

    The escape is also JSON's, so JSON output stays the same JSON."""
    return _UNSAFE_FOR_TERMINAL.sub(_escape, text)


def xml_text(text: str) -> str:
    """`text` with the characters XML 1.0 cannot hold at all (most C0 controls,
    U+FFFE/U+FFFF, lone surrogates) shown as `\\uXXXX`; ElementTree escapes the rest."""
    return _INVALID_XML.sub(_escape, text)


def script_json(value: Any) -> str:
    """JSON for a `<script type="application/json">` island: `JSON.parse(el.textContent)`
    gets `value` back. `<`, `>` and `&` are written as JSON escapes (not HTML entities,
    which a script element does not decode), so no text can close the element."""
    return (json.dumps(value, ensure_ascii=True)
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))

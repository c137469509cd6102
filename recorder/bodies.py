"""Split a request body's JSON text into its messages and the rest, byte for byte.

Agent traffic resends the whole conversation every turn, so the recorder keeps
each distinct message once (by hash) and a request as "everything but the
messages" plus a reference to its ordered message list. The conversation is the
`messages` array (Chat Completions, Anthropic Messages) or the `input` array of
items (Responses: Codex resends every item each call, like `messages`). For the original body
to come back byte for byte, the split works on the JSON *text*, never on a
re-serialised object: a message is the exact slice of the text between the
array's brackets and separators, and `head + sep.join(messages) + tail`
is the input again.

`json.JSONDecoder.raw_decode` does the parsing (C speed); this module only
walks the top-level object and the `messages` array to learn the spans.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class SplitBody:
    head: str  # text up to the first message
    messages: list[str]  # each message's exact text, in order
    sep: str  # text between consecutive messages ("" when fewer than two)
    tail: str  # text after the last message
    hashes: list[bytes] | None = None  # each message's `message_hash`, when already known

    def join(self) -> str:
        return self.head + self.sep.join(self.messages) + self.tail


# Texts longer than this are hashed a slice at a time, so a 30 MB body is not copied whole
# into UTF-8 just to be hashed (the digest of the pieces in order is the digest of the whole).
_HASH_SLICE = 1 << 20


def message_hash(text: str) -> bytes:
    """The content address of one message: 16 bytes of BLAKE2b over its exact
    UTF-8 text (collisions are out of reach at any realistic volume)."""
    if len(text) <= _HASH_SLICE:
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    h = hashlib.blake2b(digest_size=16)
    for i in range(0, len(text), _HASH_SLICE):
        # "surrogatepass" encodes each code point alone, so a cut between two halves of a pair is safe.
        h.update(text[i:i + _HASH_SLICE].encode("utf-8", "surrogatepass"))
    return h.digest()


def _ws(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def scan_object(text: str) -> tuple[dict[str, Any], dict[str, tuple[int, int]]] | None:
    """Parses a JSON object and returns it with the (start, end) span of each
    top-level value, or None when `text` is not exactly one JSON object.

    Duplicate keys keep the last value, as `json.loads` does.
    """
    try:
        return _scan_object(text)
    except (ValueError, IndexError):
        return None


def _scan_object(text: str) -> tuple[dict[str, Any], dict[str, tuple[int, int]]] | None:
    obj: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    i = _ws(text, 0)
    if text[i] != "{":
        return None
    i = _ws(text, i + 1)
    if text[i] == "}":
        return (obj, spans) if _ws(text, i + 1) == len(text) else None
    while True:
        if text[i] != '"':
            return None
        key, i = _DECODER.raw_decode(text, i)
        i = _ws(text, i)
        if text[i] != ":":
            return None
        start = _ws(text, i + 1)
        value, end = _DECODER.raw_decode(text, start)
        obj[key], spans[key] = value, (start, end)
        i = _ws(text, end)
        if text[i] == ",":
            i = _ws(text, i + 1)
            continue
        if text[i] != "}":
            return None
        return (obj, spans) if _ws(text, i + 1) == len(text) else None


def _array_items(text: str, start: int) -> list[tuple[int, int]] | None:
    """Spans of the elements of the JSON array that starts at `start`."""
    items: list[tuple[int, int]] = []
    i = _ws(text, start + 1)
    if text[i] == "]":
        return items
    while True:
        _, end = _DECODER.raw_decode(text, i)
        items.append((i, end))
        i = _ws(text, end)
        if text[i] == "]":
            return items
        if text[i] != ",":
            return None
        i = _ws(text, i + 1)


# The keys whose array is a request's conversation, in the order they are looked for.
CONVERSATION_KEYS = ("messages", "input")


def split_body(text: str) -> SplitBody | None:
    """The messages (or Responses `input` items) of a request body and the text around them.

    None when there is nothing to share: not a JSON object, no non-empty
    `messages` or `input` array, or separators that differ between elements (a
    hand-edited body; it is then stored whole, still byte for byte).
    """
    scanned = scan_object(text)
    if scanned is None:
        return None
    key = next((k for k in CONVERSATION_KEYS if isinstance(scanned[0].get(k), list)), None)
    if key is None:
        return None
    start, _ = scanned[1][key]
    try:
        items = _array_items(text, start)
    except (ValueError, IndexError):
        return None
    if not items:
        return None
    seps = {text[a_end:b_start] for (_, a_end), (b_start, _) in zip(items, items[1:])}
    if len(seps) > 1:
        return None
    return SplitBody(
        head=text[: items[0][0]],
        messages=[text[a:b] for a, b in items],
        sep=seps.pop() if seps else "",
        tail=text[items[-1][1]:],
    )

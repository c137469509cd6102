"""Keep secrets out of the recorder database.

Two mechanisms, because secrets arrive two ways:

* credential headers (`authorization`, `x-api-key`, ...) are dropped whole:
  their *name* is not secret but nothing useful survives redacting the value,
  and a dropped header cannot leak through a regex that missed a key format;
* secret-shaped strings anywhere else (bodies, other header values, the
  model's reply, which may echo a key pasted into the prompt) are replaced by
  `[REDACTED]` using configurable regexes.

Redaction is deterministic, so two requests that carried the same secret still
render identically and the prefix analysis is unaffected.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from prefixtrace.errors import InvalidRequest

REDACTED = "[REDACTED]"

DROPPED_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie"}
)

DEFAULT_PATTERNS: tuple[str, ...] = (
    # OpenAI (sk-..., sk-proj-...) and Anthropic (sk-ant-api03-...) keys. The
    # length floor keeps prose such as "sk-learn" from being redacted.
    r"\bsk-[A-Za-z0-9_\-]{16,}",
    # Bearer tokens pasted into prompts or custom headers; same length floor so
    # the phrase "Bearer tokens" survives.
    r"\bBearer\s+[A-Za-z0-9._~+/\-]{16,}=*",
    # AWS access key ids (long-term AKIA, temporary ASIA).
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
)


class Redactor:
    """Drops credential headers and masks secret-shaped strings.

    Args:
        patterns: regexes (strings or compiled) whose matches are replaced by
            `[REDACTED]`; defaults to `DEFAULT_PATTERNS`.
        drop_headers: header names (any case) removed entirely.
    """

    def __init__(
        self,
        patterns: Iterable[str | re.Pattern[str]] | None = None,
        drop_headers: Iterable[str] = DROPPED_HEADERS,
    ):
        compiled: list[re.Pattern[str]] = []
        for p in DEFAULT_PATTERNS if patterns is None else patterns:
            try:
                compiled.append(p if isinstance(p, re.Pattern) else re.compile(p))
            except re.error as exc:
                raise InvalidRequest(f"bad redaction pattern {p!r}: {exc}") from exc
        self.patterns = compiled
        self.drop_headers = frozenset(h.lower() for h in drop_headers)
        # One pass instead of one per pattern: bodies are hundreds of KB and
        # redaction is most of the writer's time. Only when every pattern has
        # the same flags (an alternation cannot mix them).
        flags = {p.flags for p in compiled}
        self._combined = (
            re.compile("|".join(f"(?:{p.pattern})" for p in compiled), flags.pop())
            if compiled and len(flags) == 1 and all(isinstance(p.pattern, str) for p in compiled) else None
        )

    def text(self, value: str) -> str:
        if self._combined is not None:
            return self._combined.sub(REDACTED, value)
        for pattern in self.patterns:
            value = pattern.sub(REDACTED, value)
        return value

    def value(self, value: Any) -> Any:
        """Redacts every string inside a JSON-like value (keys included: some
        clients put keys in dict keys, e.g. `{"sk-...": "prod"}`)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.value(k) if isinstance(k, str) else k: self.value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value

    def headers(self, headers: dict[str, str] | None) -> dict[str, str]:
        if not headers:
            return {}
        return {
            name: self.text(str(val))
            for name, val in headers.items()
            if name.lower() not in self.drop_headers
        }


DEFAULT_REDACTOR = Redactor()

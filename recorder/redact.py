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
    # GitHub tokens (classic ghp_/gho_/ghu_/ghs_/ghr_, fine-grained github_pat_): coding
    # agents meet them in remotes, CI logs and .env files they read.
    r"\bgh[pousr]_[A-Za-z0-9]{36,}",
    r"\bgithub_pat_[A-Za-z0-9_]{22,}",
    # Slack tokens and Google API keys.
    r"\bxox[abprs]-[A-Za-z0-9\-]{10,}",
    r"\bAIza[0-9A-Za-z_\-]{35}",
    # PEM private keys, header to footer (an agent that cats a key file sends all of it).
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----",
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
        # redaction is most of the writer's time. Only patterns that start at a
        # word boundary (`\b`) and share their flags go into the alternation:
        # one branch without `\b` (the PEM block) made the whole pass 6x slower
        # (6.8 -> 42 ms per 400 KB body), while such a pattern alone, led by a
        # literal, costs 0.2 ms; those run on their own.
        anchored = [p for p in compiled if isinstance(p.pattern, str) and p.pattern.startswith("\\b")]
        flags = {p.flags for p in anchored}
        if len(anchored) > 1 and len(flags) == 1:
            combined = re.compile("|".join(f"(?:{p.pattern})" for p in anchored), flags.pop())
            self._passes = [combined] + [p for p in compiled if p not in anchored]
        else:
            self._passes = compiled

    def text(self, value: str) -> str:
        for pattern in self._passes:
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

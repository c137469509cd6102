"""The hash-only store (`serve --store hashes`, docs/SECURITY.md "Hash-only recording").

For teams that may not keep prompts: every text of a turn (message contents, system prompt, tool
descriptions and schemas' texts, tool-call arguments, the reply and its reasoning) is replaced before it
is stored by a marker holding a keyed hash of the text and its token count, `⟦h:<16 hex>:<tokens>⟧`.
What is not text is kept: the structure (roles, block types, how many messages), the request's
parameters (model, tool_choice, thinking, effort), tool and call names and ids, the usage, the times,
the headers (already without credentials). Equal texts get equal markers, so the analysis still sees
where two prompts part and what they cost (analyzer/hashed.py).

The hash is an HMAC-SHA256 under a key kept beside the database (`<db>.hashkey`, owner-only): without
it, a short text ("yes", a file name) cannot be confirmed by hashing guesses.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from recorder.turn import Turn

MARKER = "⟦h:{digest}:{tokens}⟧"
MARKER_RE = re.compile(r"⟦h:([0-9a-f]{16}):(\d+)⟧")
STORE_KEY = "_prefixtrace_store"  # added to a hashed body: the analysis knows without scanning it
# String values that are names, not text: kept as they are.
KEEP = frozenset({"role", "type", "model", "name", "id", "tool_call_id", "tool_use_id", "call_id", "effort",
                  "media_type", "ttl", "stop_reason", "finish_reason", "object", "status", "tool_choice",
                  "reasoning_effort", "service_tier", "speed", "prompt_cache_key", "format"})
CACHE_ENTRIES = 4096  # texts whose counts are kept: a conversation resends the same messages every turn


def load_key(db_path: str | Path) -> bytes:
    """The database's hashing key, created (owner-only) on first use."""
    path = Path(f"{db_path}.hashkey")
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        key = secrets.token_bytes(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(key.hex())
        return key


class Hasher:
    """Turns a Turn into its hash-only form. `count` gives a text's token count (serve passes the
    analysis tokenizer's); without one, a quarter of its UTF-8 bytes."""

    def __init__(self, key: bytes, count: Callable[[str], int] | None = None):
        self.key = key
        self.count = count or (lambda text: (len(text.encode("utf-8")) + 3) // 4)
        self._seen: OrderedDict[str, str] = OrderedDict()

    def text(self, text: str) -> str:
        if not text or MARKER_RE.fullmatch(text):
            return text
        hit = self._seen.get(text)
        if hit is None:
            digest = hmac.new(self.key, text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:16]
            hit = self._seen[text] = MARKER.format(digest=digest, tokens=self.count(text))
            if len(self._seen) > CACHE_ENTRIES:
                self._seen.popitem(last=False)
        return hit

    def value(self, value: Any, key: str | None = None) -> Any:
        if isinstance(value, str):
            return value if key in KEEP else self.text(value)
        if isinstance(value, dict):
            return {k: self.value(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v, key if key in KEEP else None) for v in value]
        return value

    def turn(self, turn: Turn) -> Turn:
        body = turn.request_body
        hashed = {**self.value(body), STORE_KEY: "hashes"} if isinstance(body, dict) else \
            self.text(body) if isinstance(body, str) else body
        return replace(turn, request_body=hashed, request_raw=None,
                       response_text=self.text(turn.response_text or ""),
                       reasoning_text=self.text(turn.reasoning_text or ""),
                       tool_calls=self.value(turn.tool_calls) if turn.tool_calls is not None else None,
                       render=_without_texts(turn.render))


def _without_texts(render: dict | None) -> dict | None:
    """The engine's facts without the reply's token ids (they spell the reply)."""
    if not isinstance(render, dict):
        return render
    return {k: v for k, v in render.items() if k != "reply_token_ids"}

"""Payload level: canonical request bodies and the first changed message.

Canonicalisation drops what never reaches the prompt (`cache_control`,
`stream`, `stream_options`, `max_*tokens`, `temperature`,
`prompt_cache_key`) and flattens arrays of text parts into one string, but
keeps key order and tool order: HF chat templates render `tojson` without
sorting, so a client that reorders keys really does change the prompt.

Each message gets a key (its canonical JSON); keys are cached by object
identity, which pays off because `load.share_prefix` / the incremental
parser make unchanged messages the same objects from turn to turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

IGNORED_KEYS = frozenset({"cache_control"})
IGNORED_TOP = frozenset({"stream", "stream_options", "temperature", "prompt_cache_key", "messages", "tools", "system"})
_MAX_TOKENS_RE = re.compile(r"max_\w*tokens")
# Top-level fields that change what a server renders or which cache it uses.
PARAM_KEYS = ("model", "chat_template_kwargs", "reasoning_effort", "reasoning", "thinking", "enable_thinking")
TEXT_PART_TYPES = frozenset({"text", "input_text"})
REASONING_KEYS = ("reasoning_content", "reasoning")


def strip_ignored(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: strip_ignored(v) for k, v in value.items() if k not in IGNORED_KEYS}
    if isinstance(value, list):
        return [strip_ignored(v) for v in value]
    return value


def flatten_content(content: Any) -> Any:
    """A list of only text parts becomes one string (as servers pass it to
    the template); anything else is kept, without `cache_control`."""
    if isinstance(content, list) and content and all(
        isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return strip_ignored(content)


def canonical_message(msg: Any) -> Any:
    if not isinstance(msg, dict):
        return msg
    out = {}
    for k, v in msg.items():
        if k in IGNORED_KEYS:
            continue
        out[k] = flatten_content(v) if k == "content" else strip_ignored(v)
    return out


def messages_of(body: dict) -> list:
    """The message list, with an Anthropic-style top-level `system` first."""
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    system = body.get("system")
    if system:
        return [{"role": "system", "content": system}, *messages]
    return messages


def params_of(body: dict) -> dict:
    return {k: body[k] for k in PARAM_KEYS if k in body}


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass
class Payload:
    """The canonical view of one request: message keys, tools key, params."""

    messages: list  # the original message objects
    keys: list[str]
    tools: list
    tools_key: str
    params: dict
    chars: int  # total canonical size, for "did it shrink" (compaction)
    source_index: list | None = None  # translated bodies: chat message -> the client's message index


class Canonicalizer:
    """Builds Payloads, caching message keys by identity (the objects are
    kept alive by the session's previous Payload, so ids are not reused
    while the cache can still see them; `forget` trims it)."""

    def __init__(self) -> None:
        self._keys: dict[int, tuple[Any, str]] = {}

    def key(self, msg: Any) -> str:
        hit = self._keys.get(id(msg))
        if hit is not None and hit[0] is msg:
            return hit[1]
        k = _dumps(canonical_message(msg))
        self._keys[id(msg)] = (msg, k)
        return k

    def payload(self, body: dict) -> Payload:
        messages = messages_of(body)
        keys = [self.key(m) for m in messages]
        tools = body.get("tools") if isinstance(body.get("tools"), list) else []
        tools_c = strip_ignored(tools)
        return Payload(messages, keys, tools_c, _dumps(tools_c), params_of(body), sum(map(len, keys)),
                       body.get("_source_index"))

    def forget(self, keep: list[Payload]) -> None:
        """Drops cached keys of messages no live Payload holds."""
        live = {id(m) for p in keep for m in p.messages}
        self._keys = {i: v for i, v in self._keys.items() if i in live}


def first_changed(prev: list[str], next: list[str]) -> int:
    """Index of the first differing message key; len(prev) when `prev` is a
    prefix of `next` (append-only at the payload level)."""
    n = min(len(prev), len(next))
    if prev[:n] == next[:n]:  # C-speed, identity first: the common append-only case
        return n
    for i in range(n):
        if prev[i] is not next[i] and prev[i] != next[i]:
            return i
    return n


def _reduce(value: Any, limit: int = 256) -> Any:
    """Long strings replaced by a short fingerprint: deepdiff would otherwise
    run difflib over 100 kB system prompts, and we only need the path."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:32]}…<{len(value)} chars, hash {hash(value) & 0xFFFFFFFF:08x}>"
    if isinstance(value, dict):
        return {k: _reduce(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_reduce(v, limit) for v in value]
    return value


def first_path(prev: Any, next: Any, root: str) -> str | None:
    """The JSON path of the first difference between two (small, reduced)
    values, via deepdiff; None when equal."""
    from deepdiff import DeepDiff

    diff = DeepDiff(_reduce(prev), _reduce(next), view="tree")
    paths = sorted(
        (level.path() for items in diff.values() for level in items),
        key=lambda p: (p.count("["), p),
    )
    if not paths:
        return None
    return root + paths[0][len("root"):]

"""A parsed request body's redacted JSON text, already split into its conversation items, for
turns that share their items: each distinct item object is redacted, serialised and hashed once.

A harness transcript rebuilt into turns (recorder/transcripts/) gives every call's request the
same item objects as the call before it plus a few new ones. Serialising and redacting each body
whole costs calls x history (a 1 MB Codex rollout of 286 calls: 125 MB of JSON, 20 s); here it
costs the rollout once. The text is the one `json.dumps` writes for the redacted body (", " and
": " separators), so reading it back gives exactly the body that was stored.
"""

from __future__ import annotations

from typing import Any

from recorder import numbers
from recorder.bodies import CONVERSATION_KEYS, SplitBody, message_hash
from recorder.redact import Redactor

SEP = ", "  # json.dumps's item separator (and its key separator is ": ")


def _dumps(value: Any) -> str:
    return numbers.dumps(value, ensure_ascii=False)


class SharedItemTexts:
    """Per import: item object -> (its redacted text, its hash). Holds each item it has seen so an
    `id()` is never reused for another object while the memo lives (the items are not mutated
    once a transcript is read)."""

    def __init__(self, redactor: Redactor):
        self.redactor = redactor
        self._seen: dict[int, tuple[Any, str, bytes]] = {}

    def split(self, body: Any, utf8=lambda s: s) -> SplitBody | None:
        """`body`'s redacted text, split around its `messages` / `input` items (`utf8` makes each
        piece storable); None when it has no non-empty conversation list (stored the usual way)."""
        if not isinstance(body, dict):
            return None
        key = next((k for k in CONVERSATION_KEYS if isinstance(body.get(k), list)), None)
        if key is None or not body[key] or not all(isinstance(k, str) for k in body):
            return None
        items, hashes = [], []
        for item in body[key]:
            seen = self._seen.get(id(item))
            if seen is None or seen[0] is not item:
                text = utf8(_dumps(self.redactor.value(item)))
                seen = self._seen[id(item)] = (item, text, message_hash(text))
            items.append(seen[1])
            hashes.append(seen[2])
        rest = self.redactor.value({k: v for k, v in body.items() if k != key})
        if list(rest) != [k for k in body if k != key]:
            return None  # a key was redacted (it spelled a secret): the usual way keeps that safe
        head, tail, before = [], [], True
        for k in body:
            if k == key:
                before = False
                continue
            (head if before else tail).append(f"{_dumps(k)}: {_dumps(rest[k])}")
        opening = "{" + "".join(p + SEP for p in head) + f"{_dumps(key)}: ["
        closing = "]" + "".join(SEP + p for p in tail) + "}"
        return SplitBody(utf8(opening), items, SEP, utf8(closing), hashes)

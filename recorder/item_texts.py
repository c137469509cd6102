"""A parsed request body's redacted JSON text, already split into its conversation items, for
turns that share their items: each distinct item object is redacted, serialised and hashed once.

A harness transcript rebuilt into turns (recorder/transcripts/) gives every call's request the
same item objects as the call before it plus a few new ones. Serialising and redacting each body
whole costs calls x history (a 1 MB Codex rollout of 286 calls: 125 MB of JSON, 20 s); here it
costs the rollout once. The text is the one `json.dumps` writes for the redacted body (", " and
": " separators), so reading it back gives exactly the body that was stored.
"""

from __future__ import annotations

import operator
from typing import Any

from recorder import numbers
from recorder.bodies import CONVERSATION_KEYS, SplitBody, message_hash
from recorder.redact import Redactor

SEP = ", "  # json.dumps's item separator (and its key separator is ": ")
# Past this many characters of remembered item texts, the memo keeps only the current body's items: a
# streamed import of a multi-GB rollout (recorder/transcripts/streamed.py) must not hold every item
# it ever saw. Only a cost: an item met again after that is redacted and serialised again.
SEEN_CHARS_LIMIT = 16 << 20


def _dumps(value: Any) -> str:
    return numbers.dumps(value, ensure_ascii=False)


class SharedItemTexts:
    """Per import: item object -> (its redacted text, its hash). Holds each item it has seen so an
    `id()` is never reused for another object while the memo lives (the items are not mutated
    once a transcript is read)."""

    def __init__(self, redactor: Redactor):
        self.redactor = redactor
        self._seen: dict[int, tuple[Any, str, bytes]] = {}
        self._seen_chars = 0
        # The previous body's items, texts and hashes: the next call's items begin with the same objects.
        self._last: tuple[list, list[str], list[bytes]] = ([], [], [])

    def _forget_all_but(self, conversation: list) -> None:
        self._seen = {id(i): self._seen[id(i)] for i in conversation if id(i) in self._seen}
        self._seen_chars = sum(len(v[1]) for v in self._seen.values())

    def split(self, body: Any, utf8=lambda s: s) -> SplitBody | None:
        """`body`'s redacted text, split around its `messages` / `input` items (`utf8` makes each
        piece storable); None when it has no non-empty conversation list (stored the usual way)."""
        if not isinstance(body, dict):
            return None
        key = next((k for k in CONVERSATION_KEYS if isinstance(body.get(k), list)), None)
        if key is None or not body[key] or not all(isinstance(k, str) for k in body):
            return None
        conversation = body[key]
        last_items, last_texts, last_hashes = self._last
        n = len(last_items)
        # The same objects as the previous body's, in C (identity: equal dicts may serialise otherwise).
        k = n if len(conversation) >= n and all(map(operator.is_, conversation[:n], last_items)) else 0
        items, hashes = last_texts[:k], last_hashes[:k]
        for item in conversation[k:]:
            seen = self._seen.get(id(item))
            if seen is None or seen[0] is not item:
                text = utf8(_dumps(self.redactor.value(item)))
                seen = self._seen[id(item)] = (item, text, message_hash(text))
                self._seen_chars += len(text)
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
        self._last = (list(conversation), items, hashes)
        if self._seen_chars > SEEN_CHARS_LIMIT:
            self._forget_all_but(conversation)
        return SplitBody(utf8(opening), items, SEP, utf8(closing), hashes)

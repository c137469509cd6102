"""Where one rendered prompt stops extending the previous one, in chars and tokens.

Token counts come from per-segment counts, cached by string: a segment
(message content or template literal) is tokenized once per run however many
turns repeat it. The sum of segment counts equals the count of the whole
text when segment boundaries are also tokenizer pre-token boundaries, which
holds for ChatML-style templates (a content starts after the role line's
newline and ends before a special marker); elsewhere it is off by a token or
so per boundary. The benchmark measures the difference against full
tokenisation. The common prefix is tokenized exactly: only the window around
the first difference is tokenized afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

from analyzer.render import Rendered
from analyzer.tokens import Tokenizer

WINDOW = 160  # chars of context on each side of a break, in reports
_TAIL = 64  # chars past the divergence tokenized to settle the last common token


def common_prefix_len(a, b, _chunk: int = 4096) -> int:
    """Length of the common prefix of two strings or lists (chunked: slice
    equality runs in C, a per-item Python loop does not)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + _chunk] == b[i : i + _chunk]:
        i += _chunk
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SegmentCounter:
    """Token counts per segment string, cached for the whole run."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[str, int] = {}

    def count(self, s: str) -> int:
        n = self._cache.get(s)
        if n is None:
            n = self._cache[s] = len(self.tokenizer(s))
        return n

    def total(self, r: Rendered) -> int:
        c = self._cache
        get = c.get
        total = 0
        for s in r.segments:
            n = get(s)
            if n is None:
                n = self.count(s)
            total += n
        return total


@dataclass
class Comparison:
    append_only: bool
    common_chars: int
    common_tokens: int
    prev_chars: int
    next_chars: int
    message_index: int | None = None  # in next (in prev when next ended first)
    before: str = ""  # prev around the break
    after: str = ""  # next around the break
    window_start: int = 0  # char offset where `before`/`after` start


def compare(prev: Rendered, next: Rendered, counter: SegmentCounter) -> Comparison:
    """Compares two renderings (prev -> next)."""
    ps, ns = prev.segments, next.segments
    d, chars, toks = 0, 0, 0
    n = min(len(ps), len(ns))
    count = counter.count
    while d < n and (ps[d] is ns[d] or ps[d] == ns[d]):
        chars += len(ps[d])
        toks += count(ps[d])
        d += 1
    if d == len(ps):
        return Comparison(True, chars, toks, chars, chars + sum(map(len, ns[d:])))
    prev_rest, next_rest = "".join(ps[d:]), "".join(ns[d:])
    c = common_prefix_len(prev_rest, next_rest)
    prev_chars, next_chars = chars + len(prev_rest), chars + len(next_rest)
    if c == len(prev_rest):
        # prev ends inside a segment next extends (e.g. a grown literal): still append-only.
        return Comparison(True, chars + c, toks + len(counter.tokenizer(prev_rest)), prev_chars, next_chars)
    tok = counter.tokenizer
    common_toks = common_prefix_len(tok(prev_rest[: c + _TAIL]), tok(next_rest[: c + _TAIL]))
    offset = chars + c
    where = next if offset < next_chars else prev
    start = max(0, c - WINDOW)
    return Comparison(
        False, offset, toks + common_toks, prev_chars, next_chars,
        message_index=where.locate(offset),
        before=prev_rest[start : c + WINDOW],
        after=next_rest[start : c + WINDOW],
        window_start=chars + start,
    )

"""Where one rendered prompt stops extending the previous one, in chars and tokens.

Token counts come from per-group counts, cached for the whole run: a group
is the run of segments from one chat-marker line to the next (a boundary is
a `<|` right after a newline, where every BPE pre-tokenizer we use starts a
new pre-token), so a group is tokenized once however many turns repeat it,
and the sum of group counts equals the count of the whole text whenever
those boundaries hold. Templates without such markers form fewer, larger
groups; counts stay exact, caching gets weaker. The common prefix is
tokenized exactly: only the window around the first difference is
tokenized afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

from analyzer.render import Rendered
from analyzer.tokens import Tokenizer

WINDOW = 160  # chars of context on each side of a break, in reports
SPAN_MAX = 600  # chars past the first difference searched for where the two prompts agree again
_RESYNC = 8  # chars that must agree again for the differing span to end there
_AFTER = 80  # chars of context after the differing span, in `diff`
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


_MARK = "<|"
_BOUNDARY = "\n<|"


def token_groups(r: Rendered) -> list[tuple[str, ...]]:
    """The rendering as groups of segments (cached on the Rendered). Template
    literals are split at boundaries; contents never are, so they keep their
    identity."""
    cached = r.__dict__.get("_groups")
    if cached is not None:
        return cached
    groups: list[tuple[str, ...]] = []
    cur: list[str] = []
    for seg, kind in zip(r.segments, r.kinds):
        if kind == "" and _BOUNDARY in seg:
            parts = seg.split(_BOUNDARY)
            pieces = [parts[0] + "\n", *(_MARK + p + "\n" for p in parts[1:-1]), _MARK + parts[-1]]
        else:
            pieces = [seg]
        for piece in pieces:
            if not piece:
                continue
            if cur and piece.startswith(_MARK) and cur[-1].endswith("\n"):
                groups.append(tuple(cur))
                cur = []
            cur.append(piece)
    if cur:
        groups.append(tuple(cur))
    r.__dict__["_groups"] = groups
    return groups


class SegmentCounter:
    """Token counts per group, cached for the whole run (tuple keys hash
    their strings, and a content string caches its own hash)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[tuple[str, ...], int] = {}

    def count(self, group: tuple[str, ...]) -> int:
        n = self._cache.get(group)
        if n is None:
            n = self._cache[group] = len(self.tokenizer("".join(group)))
        return n

    def total(self, r: Rendered) -> int:
        return sum(map(self.count, token_groups(r)))


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
    diff: dict | None = None  # windows around the differing characters and their spans (`diff_window`)


def differing_span(a: str, b: str, limit: int = SPAN_MAX) -> tuple[int, int]:
    """Where two texts that differ from their first character agree again: (end in a, end in b), the
    ends of the differing characters. The first run of `_RESYNC` equal characters (or an equal run that
    reaches the end of either text) after the start ends the span; none within `limit` chars: the span
    runs to `limit` (or the end of the text)."""
    import difflib

    a, b = a[:limit], b[:limit]
    for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        if block.size >= _RESYNC or (block.size and (block.a + block.size == len(a) or block.b + block.size == len(b))):
            return block.a, block.b
    return len(a), len(b)


def diff_window(prev_text: str, next_text: str, c: int) -> dict:
    """The two sides of a break for display: `before` (previous prompt) and `after` (this prompt), each
    from WINDOW chars before the first difference `c` to _AFTER chars past the differing span, and that
    span inside each window: [start, before_end) in `before`, [start, after_end) in `after` (a caret
    line in the CLI, highlighting in HTML). `offset` is where the windows start in the renderings."""
    a_end, b_end = differing_span(prev_text[c:], next_text[c:])
    lo = max(0, c - WINDOW)
    return {"before": prev_text[lo : c + a_end + _AFTER], "after": next_text[lo : c + b_end + _AFTER],
            "start": c - lo, "before_end": c - lo + a_end, "after_end": c - lo + b_end, "offset": lo}


def compare(prev: Rendered, next: Rendered, counter: SegmentCounter) -> Comparison:
    """Compares two renderings (prev -> next)."""
    ps, ns = token_groups(prev), token_groups(next)
    d, chars, toks = 0, 0, 0
    n = min(len(ps), len(ns))
    count = counter.count
    while d < n and ps[d] == ns[d]:  # tuple equality tries identity first, element by element
        chars += sum(map(len, ps[d]))
        toks += count(ps[d])
        d += 1
    if d == len(ps):
        return Comparison(True, chars, toks, chars, chars + sum(len(s) for g in ns[d:] for s in g))
    prev_rest = "".join(s for g in ps[d:] for s in g)
    next_rest = "".join(s for g in ns[d:] for s in g)
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
    diff = diff_window(prev_rest, next_rest, c)
    diff["offset"] += chars
    return Comparison(
        False, offset, toks + common_toks, prev_chars, next_chars,
        message_index=where.locate(offset),
        before=prev_rest[start : c + WINDOW],
        after=next_rest[start : c + WINDOW],
        window_start=chars + start,
        diff=diff,
    )

"""Where one request's rendered prompt stops extending the previous one's.

A pair is `append_only` when the previous prompt (without its trailing
generation prompt, which the next request legitimately replaces with a user
or tool message) is a prefix of the next rendering: then the server's prefix
cache can reuse all of it. Otherwise it `diverged`, and everything after the
first differing character must be prefilled again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from analyzer.render import Rendered, render_request
from analyzer.tokens import Tokenizer, as_tokenizer

EXCERPT_CHARS = 40


@dataclass(frozen=True)
class Divergence:
    """Comparison of two consecutive requests (prev -> next).

    `offset` is the first differing char in the whole rendered text (None when
    append-only). `message_index`/`offset_in_message` locate it in `next`'s
    messages (in `prev`'s when next is shorter); `offset_in_message` counts
    from the start of the message's rendered content and is None when the
    divergence is in the role line, the tools block or past the end.
    """

    classification: str  # "append_only" | "diverged"
    common_chars: int
    common_tokens: int
    prev_tokens: int
    next_tokens: int
    tokenizer: str
    offset: int | None = None
    region: str | None = None  # "tools" | "header" | "body" | "generation_prompt" | "end"
    message_index: int | None = None
    offset_in_message: int | None = None
    before: str = ""  # text just before the divergence (shared by both)
    prev_after: str = ""  # what prev had from there
    next_after: str = ""  # what next has from there

    @property
    def append_only(self) -> bool:
        return self.classification == "append_only"

    def describe(self) -> str:
        if self.append_only:
            return "append-only"
        if self.region == "tools":
            return f"tools @ char {self.offset}"
        where = f"msg {self.message_index}" if self.message_index is not None else (self.region or "?")
        if self.offset_in_message is not None:
            return f"{where} @ char {self.offset_in_message}"
        return f"{where} ({self.region})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"append_only": self.append_only}


def common_prefix_len(a: str | list, b: str | list, _chunk: int = 4096) -> int:
    """Length of the common prefix of two strings or token lists. Compares
    in chunks first: prompts run to hundreds of kB, and slice equality runs
    in C while a per-char Python loop does not."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + _chunk] == b[i : i + _chunk]:
        i += _chunk
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def compare_rendered(
    prev: Rendered,
    next: Rendered,
    tokenizer: Tokenizer | Callable[[str], list[int]] | None = None,
    *,
    prev_ids: list[int] | None = None,
    next_ids: list[int] | None = None,
) -> Divergence:
    """Compares two renderings. Pass `prev_ids`/`next_ids` (token ids of the
    full texts) to avoid re-tokenizing when walking a session."""
    tok = as_tokenizer(tokenizer)
    prev_ids = tok(prev.text) if prev_ids is None else prev_ids
    next_ids = tok(next.text) if next_ids is None else next_ids
    common_chars = common_prefix_len(prev.text, next.text)
    base = dict(
        common_chars=common_chars,
        common_tokens=common_prefix_len(prev_ids, next_ids),
        prev_tokens=len(prev_ids),
        next_tokens=len(next_ids),
        tokenizer=tok.name,
    )
    if common_chars >= prev.prompt_end:
        return Divergence("append_only", **base)

    # Locate in `next` unless it ended first (a truncated/shortened request).
    where = next if common_chars < len(next.text) else prev
    region, index, in_msg = where.locate(common_chars)
    return Divergence(
        "diverged",
        **base,
        offset=common_chars,
        region=region,
        message_index=index,
        offset_in_message=in_msg,
        before=prev.text[max(0, common_chars - EXCERPT_CHARS) : common_chars],
        prev_after=prev.text[common_chars : common_chars + EXCERPT_CHARS],
        next_after=next.text[common_chars : common_chars + EXCERPT_CHARS],
    )


def compare(prev_body: Any, next_body: Any, tokenizer=None) -> Divergence:
    """Compares two request bodies (dicts as sent to /v1/chat/completions)."""
    return compare_rendered(render_request(prev_body), render_request(next_body), tokenizer)

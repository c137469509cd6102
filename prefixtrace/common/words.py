"""Counted nouns as a person writes them: "1 turn", "2 turns", "1,404 tokens", never "1 turns" or
"break(s)"."""

from __future__ import annotations


def plural(count: int, word: str, many: str | None = None) -> str:
    """`count` and `word`, plural unless the count is one: plural(1, "turn") -> "1 turn",
    plural(1404, "token") -> "1,404 tokens", plural(2, "request chain") -> "2 request chains";
    `many` for an irregular plural."""
    if count == 1:
        return f"1 {word}"
    return f"{count:,} {many or word + 's'}"

"""Anthropic's lookback limit (`lookback`, docs/ANALYZER.md "Lookback").

Anthropic looks for a cached prefix at each `cache_control` breakpoint and at the block boundaries
before it, up to 20 content blocks back, and no further. A turn that adds more than 20 blocks since
the session's newest cache write (one assistant turn of many parallel tool calls, and their results)
has its conversation prefix cached but cannot find it: the whole tail is written again. The rendered
prompt only grew, so nothing else names it.

Blocks are counted as the API sees them, in its cache order: each tool, each system block (a string
system prompt is one), each message's content blocks (a string content is one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOOKBACK_BLOCKS = 20  # Anthropic prompt caching: "up to 20 blocks before your explicit breakpoint"


@dataclass
class Blocks:
    total: int
    breakpoints: list[int]  # block boundaries (1-based: after block n) carrying cache_control
    message_of: list[int | None]  # the client's message index of each block (None: tools, system)


def _has_marker(block: Any) -> bool:
    return isinstance(block, dict) and isinstance(block.get("cache_control"), dict)


def cache_blocks(body: Any, endpoint: str | None) -> Blocks | None:
    """The content blocks and breakpoints of a Messages request as sent, None for other requests."""
    if endpoint != "/v1/messages" or not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return None
    owners: list[int | None] = []
    marks: list[int] = []

    def add(block: Any, owner: int | None) -> None:
        owners.append(owner)
        if _has_marker(block):
            marks.append(len(owners))

    for tool in body.get("tools") if isinstance(body.get("tools"), list) else []:
        add(tool, None)
    system = body.get("system")
    for block in system if isinstance(system, list) else [system] if system else []:
        add(block, None)
    for i, m in enumerate(body["messages"]):
        content = m.get("content") if isinstance(m, dict) else None
        for block in content if isinstance(content, list) else [content]:
            add(block, i)
        if isinstance(m, dict) and _has_marker(m):
            marks.append(len(owners))
    if isinstance(body.get("cache_control"), dict) and owners:  # automatic caching: the last block
        marks.append(len(owners))
    return Blocks(len(owners), sorted(set(marks)), owners)


@dataclass
class Lookback:
    behind: int  # blocks between the newest write and the request's last breakpoint
    newest_write: int
    breakpoint: int
    hit: int  # the block boundary the lookup does find (0: none)


def lookback_miss(blocks: Blocks | None, writes: list[int]) -> Lookback | None:
    """The miss when no breakpoint of this request has the session's newest cache write (at or before its
    last breakpoint) within LOOKBACK_BLOCKS blocks behind it; `hit` is the newest write its breakpoints
    still find (an older one, e.g. the system prompt's), 0 when none."""
    if blocks is None or not blocks.breakpoints or not writes:
        return None
    last = blocks.breakpoints[-1]
    newest = max((w for w in writes if w <= last), default=None)
    if newest is None or any(b - LOOKBACK_BLOCKS <= newest <= b for b in blocks.breakpoints):
        return None
    behind = min(b - newest for b in blocks.breakpoints if b >= newest)
    hit = max((w for b in blocks.breakpoints for w in writes if b - LOOKBACK_BLOCKS <= w <= b), default=0)
    return Lookback(behind, newest, newest + behind, hit)


def fix_text(miss: Lookback) -> str:
    return (f"this request's cache breakpoint is {miss.behind} content blocks past the session's newest cache "
            f"write and Anthropic looks back only {LOOKBACK_BLOCKS}: put a second cache_control breakpoint "
            f"within {LOOKBACK_BLOCKS} blocks of the previous request's (e.g. on the first tool_result of a "
            f"long batch), or send fewer blocks per turn (fold parallel tool results into fewer blocks)")

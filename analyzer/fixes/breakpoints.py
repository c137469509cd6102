"""`breakpoints` (Anthropic Messages; cause: server_miss on a provider that caches only at marked
blocks): one `cache_control` breakpoint on the last cacheable block when the client set none.

Anthropic caches a prefix only up to a block marked `cache_control`; a client that marks nothing
pays full price every turn. The fix marks the last cacheable block of the last message, so each turn
writes the prefix the next one reads. It stands aside when the client set any breakpoint of its own
(tools, system or messages: the client chose) and never lets the count across tools, system and
messages exceed the provider's limit of 4. What the model reads does not change: a breakpoint is
not rendered.
"""

from __future__ import annotations

import copy

from analyzer.fixes import shape
from analyzer.fixes.base import Outcome, SessionRecord, stands_aside

NAME = "breakpoints"
MAX_BREAKPOINTS = 4
UNCACHEABLE = ("thinking", "redacted_thinking")


def count_breakpoints(body: dict) -> int:
    """`cache_control` marks across tools, system blocks and message blocks."""
    n = sum(1 for t in shape.tools_of(body) or [] if isinstance(t, dict) and t.get("cache_control"))
    system = body.get("system")
    blocks = list(system) if isinstance(system, list) else []
    for message in body.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            blocks.extend(message["content"])
    return n + sum(1 for b in blocks if isinstance(b, dict) and b.get("cache_control"))


def fix(body: dict, protocol: str, record: SessionRecord) -> Outcome:
    if protocol != "messages":
        return stands_aside("breakpoints are an Anthropic Messages feature (other servers cache without them)")
    existing = count_breakpoints(body)
    if existing:
        return stands_aside(f"the client set its own breakpoints ({existing})")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return stands_aside("the request has no message to mark")
    new = copy.deepcopy(body)
    last = new["messages"][-1]
    content = last.get("content")
    if isinstance(content, str):
        if not content:
            return stands_aside("the last message is empty (an empty text block is invalid)")
        last["content"] = content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        return stands_aside("the last message has no content blocks")
    for block in reversed(content):
        if isinstance(block, dict) and block.get("type") not in UNCACHEABLE and block.get("type"):
            block["cache_control"] = {"type": "ephemeral"}
            break
    else:
        return stands_aside("the last message has no cacheable block")
    if count_breakpoints(new) > MAX_BREAKPOINTS:  # cannot happen from 0, kept as the rule's guard
        return stands_aside(f"a breakpoint more would pass the limit of {MAX_BREAKPOINTS}")
    return Outcome(new, f"breakpoint set on the last {block['type']} block")

"""`thinking` (cause: thinking_strip): reasoning the client stripped from an earlier assistant turn goes
back in, from the proxy's own record of that reply, where the server's chat template renders it.

A template that renders earlier turns' reasoning sees a prompt that changed under the cache when the
client drops it; putting back the very text the model produced restores the bytes the server cached.
Where the template drops earlier reasoning itself, stripping changes nothing and the fix stands aside;
where it is not known (an upstream that publishes no template) it stands aside too. Only chat
completions carry reasoning as plain text (`reasoning_content`); Anthropic thinking blocks need the
provider's signature and Responses reasoning items its encrypted content, which no record holds.
"""

from __future__ import annotations

import copy

from analyzer.fixes import shape
from analyzer.fixes.base import Outcome, SessionRecord, reply_key, stands_aside
from prefixtrace.wire.request import joined_text

NAME = "thinking"
REASONING_KEYS = ("reasoning_content", "reasoning")


def fix(body: dict, protocol: str, record: SessionRecord) -> Outcome:
    if protocol != "chat":
        return stands_aside("only chat completions carry earlier reasoning as text "
                            "(Messages thinking needs its signature, Responses its encrypted content)")
    if record.template_keeps_reasoning is None:
        return stands_aside("the server's chat template is not known: whether it keeps earlier reasoning is unknown")
    if not record.template_keeps_reasoning:
        return stands_aside("the server's chat template drops earlier reasoning: stripping it breaks nothing")
    items = shape.conversation(body, protocol) or []
    new = copy.deepcopy(body)
    restored = 0
    for item, original in zip(shape.conversation(new, protocol) or [], items):
        if not isinstance(item, dict) or item.get("role") != "assistant":
            continue
        if any(isinstance(original.get(k), str) and original.get(k) for k in REASONING_KEYS):
            continue
        ids = [c.get("id") for c in item.get("tool_calls") or [] if isinstance(c, dict) and isinstance(c.get("id"), str)]
        reasoning = record.reasoning.get(reply_key(joined_text(item.get("content")), ids))
        if reasoning:
            item["reasoning_content"] = reasoning
            restored += 1
    if not restored:
        return stands_aside("no stripped reasoning of a reply this proxy recorded")
    return Outcome(new, f"stripped reasoning put back ({restored} assistant turn(s))")

"""`tool-args` (cause: serialization / history_edit inside an assistant tool call): the arguments of an
assistant tool call replayed in history go upstream exactly as the model emitted them.

A client that parses a tool call's arguments and writes them back (other spacing, other key order,
escaped unicode) changes bytes the server rendered into its cache. The proxy recorded each call's
arguments as the model emitted them (`SessionRecord.tool_args`, by call id); where the history's
arguments are the same JSON value, the recorded spelling goes instead. Arguments whose value differs
(the client edited them) are left as they are: the fix never changes what a call said.
Chat completions and Responses carry arguments as a string; Anthropic Messages as an object, whose key
order is restored.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from analyzer.fixes import shape
from analyzer.fixes.base import Outcome, SessionRecord, stands_aside

NAME = "tool-args"


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, TypeError):
        return None


def fix(body: dict, protocol: str, record: SessionRecord) -> Outcome:
    items = shape.conversation(body, protocol)
    if not items:
        return stands_aside("the request has no message history")
    if not record.tool_args:
        return stands_aside("no tool call of this session was recorded by the proxy")
    new = copy.deepcopy(body)
    restored = differs = 0
    for item in shape.conversation(new, protocol):
        if not isinstance(item, dict):
            continue
        for holder, key, call_id in _calls(item, protocol):
            emitted = record.tool_args.get(call_id)
            if emitted is None:
                continue
            sent = holder.get(key)
            if protocol == "messages":
                value = _parsed(emitted)  # a dict keeps the emitted key order
                if value != sent:
                    differs += value is not None
                    continue
                if json.dumps(value, ensure_ascii=False) != json.dumps(sent, ensure_ascii=False):
                    holder[key] = value
                    restored += 1
            elif isinstance(sent, str) and sent != emitted:
                if _parsed(sent) is not None and _parsed(sent) == _parsed(emitted):
                    holder[key] = emitted
                    restored += 1
                else:
                    differs += 1
    if not restored:
        why = f"{differs} call(s) edited by the client, left as sent" if differs else \
            "every replayed call already reads as the model emitted it"
        return stands_aside(why)
    return Outcome(new, f"tool-call arguments re-spelled as emitted ({restored} call(s))")


def _calls(item: dict, protocol: str):
    """(holder, key of the arguments, call id) of each tool call in one history item."""
    if protocol == "chat" and item.get("role") == "assistant":
        for call in item.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(call.get("id"), str):
                yield fn, "arguments", call["id"]
    elif protocol == "responses" and item.get("type") == "function_call" and isinstance(item.get("call_id"), str):
        yield item, "arguments", item["call_id"]
    elif protocol == "messages" and item.get("role") == "assistant" and isinstance(item.get("content"), list):
        for block in item["content"]:
            if isinstance(block, dict) and block.get("type") == "tool_use" and isinstance(block.get("id"), str):
                yield block, "input", block["id"]

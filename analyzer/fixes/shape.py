"""Where each protocol keeps what the fixes rewrite: the system head, the message list, the newest
user-side message, the tools and the tool calls.

Four protocols spell one conversation four ways (chat completions, Anthropic Messages, OpenAI
Responses, legacy completions); the fixes ask these helpers instead of knowing every spelling. All
of them read a body and never change it: a fix copies the body (`copy.deepcopy`) before it writes.
"""

from __future__ import annotations

from typing import Any

PROTOCOLS = ("chat", "messages", "responses", "completions")
HEAD_ROLES = ("system", "developer")


def conversation(body: dict, protocol: str) -> list | None:
    """The body's message list (Responses: its `input` items), or None when it has none."""
    key = "input" if protocol == "responses" else "messages"
    if protocol == "completions":
        return None
    items = body.get(key)
    return items if isinstance(items, list) else None


def text_parts(content: Any) -> list[tuple[Any, str]]:
    """(index within `content` or None for a plain string, text) for each text piece of a content
    value: a string, or a list of parts with a string `text`."""
    if isinstance(content, str):
        return [(None, content)]
    if isinstance(content, list):
        return [(i, p["text"]) for i, p in enumerate(content)
                if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return []


def set_text(holder: dict, key: str, index: Any, text: str) -> None:
    """Writes `text` where `text_parts(holder[key])` found the piece at `index`."""
    if index is None:
        holder[key] = text
    else:
        holder[key][index]["text"] = text


def head_slots(body: dict, protocol: str) -> list[tuple[tuple, dict, str, Any]]:
    """The system head's text pieces as (slot key, holder, key in holder, piece index): Messages'
    `system`, Responses' `instructions` and leading system/developer items, chat's leading
    system/developer messages."""
    slots: list[tuple[tuple, dict, str, Any]] = []
    if protocol == "messages":
        for index, _ in text_parts(body.get("system")):
            slots.append((("system", index), body, "system", index))
    if protocol == "responses":
        for index, _ in text_parts(body.get("instructions")):
            slots.append((("instructions", index), body, "instructions", index))
    if protocol in ("chat", "responses"):
        for m, message in enumerate(conversation(body, protocol) or []):
            if not isinstance(message, dict) or message.get("role") not in HEAD_ROLES:
                break
            for index, _ in text_parts(message.get("content")):
                slots.append((("head", m, index), message, "content", index))
    return slots


def is_user_side(item: Any) -> bool:
    """A message the client side wrote: a user message, a tool result (chat's role `tool`, a
    Responses `function_call_output`)."""
    if not isinstance(item, dict):
        return False
    return item.get("role") in ("user", "tool") or item.get("type") == "function_call_output"


def tail_holder(item: dict) -> tuple[str, Any] | None:
    """(key, value) of the part of a user-side message that text can be appended to: `content` (a
    string or a list of parts) or a Responses tool output's `output` string."""
    if item.get("type") == "function_call_output":
        return ("output", item["output"]) if isinstance(item.get("output"), str) else None
    content = item.get("content")
    return ("content", content) if isinstance(content, (str, list)) else None


def append_text(item: dict, text: str, protocol: str) -> bool:
    """Appends `text` at the end of a user-side message, as a string or a new text part in the
    protocol's spelling; False when the message has nowhere to take it."""
    found = tail_holder(item)
    if found is None:
        return False
    key, value = found
    if isinstance(value, str):
        item[key] = value + text
    else:
        kind = "input_text" if protocol == "responses" else "text"
        value.append({"type": kind, "text": text})
    return True


def tools_of(body: dict) -> list | None:
    tools = body.get("tools")
    return tools if isinstance(tools, list) else None


def tool_name(tool: Any) -> str | None:
    """A tool definition's name in any protocol (chat nests it under `function`)."""
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function")
    name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
    return name if isinstance(name, str) else None

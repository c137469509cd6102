"""OpenAI's Responses API (`POST /v1/responses`) ↔ the wire model.

In (`to_chat_body`): `instructions` becomes the first system message; `input` is a string (one
user message) or a list of items: messages (`role` user/assistant/system/developer, content a
string or `input_text`/`output_text` parts), `function_call` items (merged into one assistant
message's `tool_calls`, as chat templates expect), `function_call_output` items (`tool`
messages) and `reasoning` items (the next assistant message's `reasoning_content`). Function
tools are flat here (`{type: function, name, parameters}`) and nested in chat; other tool types
(hosted tools, Codex's `custom` tools) have no chat form and are left out of the rendered
prompt, logged once. `text.format` json_schema becomes `response_format`.

Out: `ResponsesWriter` (proxy side, over reply events) and `ResponsesReader` (an upstream's
stream or body back into reply events) live in `prefixtrace.wire.responses_stream`.
"""

from __future__ import annotations

import logging
from typing import Any

from prefixtrace.common.errors import InvalidRequest

log = logging.getLogger("prefixtrace.wire")
PATH = "/v1/responses"
# OpenAI's remote compaction: the history in, its replacement (kept items + an opaque `compaction`
# item) out, unary. Codex calls it for a provider named OpenAI; no model turn of the loop.
COMPACT_PATH = "/v1/responses/compact"
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
_logged_once: set[str] = set()


def session_id(body: dict, headers: dict[str, str]) -> str | None:
    """Codex sends its conversation as `prompt_cache_key` and a `session_id` header."""
    lower = {k.lower(): v for k, v in (headers or {}).items()}
    for value in (lower.get("x-session-id"), lower.get("session_id"), lower.get("session-id"),
                  body.get("prompt_cache_key"), body.get("user")):
        if isinstance(value, str) and value:
            return value
    return None


def input_items(body: dict) -> list[dict]:
    """`input` as a list of items (a string is one user message)."""
    value = body.get("input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return value
    if value is None:
        return []
    raise InvalidRequest("'input' must be a string or an array of items", param="input")


def to_chat_messages(body: dict, previous: list[dict] | None = None) -> list[dict]:
    """The conversation in chat shape: instructions, the stored conversation `previous` (when the
    request continues one), then the input items."""
    chat: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string", param="instructions")
    if instructions:
        chat.append({"role": "system", "content": instructions})
    chat.extend(previous or [])  # a stored conversation, without its own instructions (they do not carry over)
    pending_reasoning: list[str] = []
    for i, item in enumerate(input_items(body)):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"input[{i}].role must be user, assistant, system or developer, got {role!r}",
                                     param="input")
            message: dict[str, Any] = {"role": role, "content": _text(item.get("content"), f"input[{i}].content")}
            if role == "assistant" and pending_reasoning:
                message["reasoning_content"], pending_reasoning = "".join(pending_reasoning), []
            chat.append(message)
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise InvalidRequest(f"input[{i}]: a function_call needs a string 'name' and 'arguments'",
                                     param="input")
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            last = chat[-1] if chat else None
            if last is not None and last.get("role") == "assistant" and not pending_reasoning:
                last.setdefault("tool_calls", []).append(call)  # one assistant turn calls several tools
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if pending_reasoning:
                    message["reasoning_content"], pending_reasoning = "".join(pending_reasoning), []
                chat.append(message)
        elif kind == "function_call_output":
            chat.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _text(item.get("output", ""), f"input[{i}].output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            pending_reasoning.append(_text(parts, f"input[{i}].content") if parts else "")
        elif kind == "item_reference":
            raise InvalidRequest(f"input[{i}]: item references need stored items; send the items themselves",
                                 param="input")
        else:
            _log_once(f"input item {kind!r}", "left out of the rendered prompt")
    return chat


def to_chat_tools(tools: Any) -> list[dict] | None:
    """Flat Responses function tools → chat tools; other kinds have no chat form."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be an array", param="tools")
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{j}] must be an object", param="tools")
        if tool.get("type") != "function":
            _log_once(f"tool type {tool.get('type')!r}", "left out of the rendered prompt")
            continue
        if not isinstance(tool.get("name"), str):
            raise InvalidRequest(f"tools[{j}] must have a string 'name'", param="tools")
        # Key order as chat clients send it, as in prefixtrace/wire/messages.py (templates dump tools as JSON).
        fn: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("parameters") or {"type": "object"}
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice  # auto | none | required
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    return None


def to_chat_body(body: dict, previous: list[dict] | None = None) -> dict:
    """The chat-completions body the engine renders for a Responses body."""
    messages = to_chat_messages(body, previous)
    if not any(m.get("role") != "system" for m in messages):
        raise InvalidRequest("'input' is required: a string or a non-empty array of items", param="input")
    out: dict[str, Any] = {
        "model": body.get("model"), "messages": messages, "stream": body.get("stream"),
        "max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "tools": to_chat_tools(body.get("tools")),
        "tool_choice": _tool_choice(body.get("tool_choice")), "user": body.get("user"),
        "prompt_cache_key": body.get("prompt_cache_key"), "parallel_tool_calls": body.get("parallel_tool_calls"),
    }
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        out["reasoning_effort"] = reasoning["effort"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {"name": fmt.get("name", "output"), "schema": fmt.get("schema") or {}}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    return {k: v for k, v in out.items() if v is not None}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "refusal" and isinstance(part.get("refusal"), str):
                parts.append(part["refusal"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"{where}: a part of type {kind!r} is not supported by this engine",
                                     param="input")
        return "".join(parts)
    if content is None:
        return ""
    raise InvalidRequest(f"{where} must be a string or an array of parts", param="input")


def _log_once(what: str, outcome: str) -> None:
    if what not in _logged_once:
        _logged_once.add(what)
        log.info("Responses %s: %s", what, outcome)


def compaction_marks(body: Any) -> frozenset[str]:
    """The `compaction` items a Responses body's input carries (their opaque content): a new one
    says the server replaced the history since the request before (OpenAI's remote compaction)."""
    items = body.get("input") if isinstance(body, dict) else None
    if not isinstance(items, list):
        return frozenset()
    return frozenset(str(i.get("encrypted_content") or i.get("id") or "") for i in items
                     if isinstance(i, dict) and i.get("type") == "compaction")

"""One reading of a request body, whatever the API, and the server's own clean-up before the template.

Two jobs, both protocol-independent (no server, engine or FastAPI imports):

1. `ChatNormalizer.to_chat(body, endpoint)`: a chat-completions, Anthropic Messages or OpenAI
   Responses body as one chat-shaped request (`messages` with the system prompt first, OpenAI-shaped
   `tools`, the parameters that decide the prompt). The translation is the one the proxy applies
   before its engine renders a Messages request (proxy/anthropic.py): `system` first, `tool_use` ->
   `tool_calls` (arguments as JSON text), `tool_result` -> `tool` messages, `thinking` ->
   `reasoning_content`; Responses `instructions` -> system, `function_call` items -> the assistant's
   `tool_calls`, `function_call_output` -> `tool` messages, `reasoning` items -> the next assistant's
   `reasoning_content`. Unlike the proxy it is lenient: a block it cannot render becomes a short
   placeholder instead of a 400, because an analysis must read what was sent, not judge it. A body
   that is none of the three raises `UnreadableBody` with the reason.

   Converted messages are cached by the identity of the source message: a recorded session resends
   its whole history every turn, and the analyzer's loader makes unchanged messages the same objects
   from line to line, so each message is translated once and its translation is the same object in
   every later turn (which keeps the analyzer's per-message caches hitting).

2. `template_message(msg)`: what servers do to a chat message before the chat template sees it,
   shared by the analyzer's renderer and the engine (engine/chat_render.py), documented in
   docs/ANALYZER.md ("Render as servers render"):
   - `content: null` (an assistant turn that only calls tools, the OpenAI shape) -> "" (templates
     such as Qwen3's do `'</think>' in message.content`, which fails on None);
   - an array of text parts -> their texts joined (parts of other types are kept);
   - role `developer` -> `system` (OpenAI's newer name for the same thing; templates know `system`);
   - tool-call `arguments` given as JSON text -> the parsed object, and an empty `tool_calls` list
     dropped, as vLLM does before every template (vllm/entrypoints/chat_utils.py
     `_postprocess_messages`: "tool call arguments ... need to be dicts not JSON str"), so a client
     that re-serialises its arguments renders the same prompt.
   The message is returned unchanged (the same object) when none of this applies.
"""

from __future__ import annotations

import json
from typing import Any

from prefixtrace.wire.messages import thinking_template_kwargs

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "summary_text", "reasoning_text"})
# Top-level fields carried over unchanged: what decides the prompt or the cache.
CARRIED = ("model", "chat_template_kwargs", "reasoning_effort", "reasoning", "thinking", "enable_thinking",
           "stream", "max_tokens", "max_completion_tokens", "max_output_tokens", "temperature", "metadata", "user",
           "prompt_cache_key")
API_CHAT, API_MESSAGES, API_RESPONSES = "chat", "messages", "responses"


class UnreadableBody(ValueError):
    """The body is not a request of any API this module reads; the message says why."""


def api_of(body: Any, endpoint: str | None = None) -> str:
    """Which API a body belongs to: the endpoint's path when known, else its shape."""
    if not isinstance(body, dict):
        raise UnreadableBody(f"request body is a JSON {type(body).__name__}, not an object")
    path = (endpoint or "").rstrip("/")
    if path.endswith("/messages"):
        return API_MESSAGES
    if path.endswith("/responses"):
        return API_RESPONSES
    if path.endswith("/chat/completions"):
        return API_CHAT
    if isinstance(body.get("messages"), list):
        if "system" in body or "anthropic_version" in body or _has_anthropic_blocks(body["messages"]):
            return API_MESSAGES
        return API_CHAT
    if "input" in body or "instructions" in body:
        return API_RESPONSES
    raise UnreadableBody('no "messages" list (chat completions, Messages) or "input" (Responses) in the body')


def _has_anthropic_blocks(messages: list) -> bool:
    for m in messages[:8]:  # the shape shows in the first messages; no need to scan a long history
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in (
                "tool_use", "tool_result", "thinking", "redacted_thinking") for b in content):
            return True
    return False


def text_of(content: Any) -> str:
    """Text of a string or an array of blocks/parts; a non-text block becomes `[type]`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for block in content:
            if isinstance(block, str):
                out.append(block)
            elif isinstance(block, dict) and block.get("type") in TEXT_PART_TYPES and isinstance(block.get("text"), str):
                out.append(block["text"])
            else:
                out.append(f"[{block.get('type') if isinstance(block, dict) else type(block).__name__}]")
        return "".join(out)
    return json.dumps(content, ensure_ascii=False)


def chat_tool(tool: Any) -> Any:
    """An OpenAI-, Anthropic- or Responses-shaped tool as the OpenAI chat shape
    `{"type": "function", "function": {"name", "description", "parameters"}}`, so that the same tool
    compares equal whichever API carried it. Key order follows the proxy's translation; a tool that is
    none of these (a server tool such as web_search) is kept as it is."""
    if not isinstance(tool, dict):
        return tool
    if isinstance(tool.get("function"), dict):
        return tool
    if "input_schema" in tool and isinstance(tool.get("name"), str):  # Anthropic
        fn: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("input_schema") or {"type": "object"}
        return {"type": "function", "function": fn}
    if tool.get("type") == "function" and isinstance(tool.get("name"), str):  # Responses
        fn = {"name": tool["name"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("parameters") or {"type": "object"}
        return {"type": "function", "function": fn}
    return tool


def chat_tools(tools: Any) -> Any:
    if not isinstance(tools, list):
        return tools
    out = [chat_tool(t) for t in tools]
    return tools if all(a is b for a, b in zip(out, tools)) else out


class ChatNormalizer:
    """`to_chat` for a run of requests, with per-source-message caches (see the module doc)."""

    def __init__(self) -> None:
        self._messages: dict[int, tuple[Any, list[dict]]] = {}
        self._system: dict[int, tuple[Any, dict]] = {}
        self._tools: dict[int, tuple[Any, Any]] = {}

    def to_chat(self, body: Any, endpoint: str | None = None) -> dict:
        api = api_of(body, endpoint)
        if api == API_CHAT:
            if not isinstance(body.get("messages"), list):
                raise UnreadableBody('a chat-completions body needs a "messages" list')
            tools = self._chat_tools(body.get("tools"))
            return body if tools is body.get("tools") else {**body, "tools": tools}
        out: dict[str, Any] = {k: body[k] for k in CARRIED if k in body}
        out["messages"] = self._messages_body(body) if api == API_MESSAGES else self._responses_body(body)
        if body.get("tools"):
            out["tools"] = self._chat_tools(body["tools"])
            if api == API_RESPONSES:  # hosted and namespace tools have no chat form: the engine leaves them out
                out["tools"] = [t for t in out["tools"] if isinstance(t, dict) and isinstance(t.get("function"), dict)]
                if not out["tools"]:
                    del out["tools"]
        kwargs = thinking_template_kwargs(body.get("thinking")) if api == API_MESSAGES else None
        if kwargs is not None and "chat_template_kwargs" not in out:  # as the proxy passes it to the engine
            out["chat_template_kwargs"] = kwargs
        return out

    def _chat_tools(self, tools: Any) -> Any:
        if not isinstance(tools, list):
            return tools
        hit = self._tools.get(id(tools))
        if hit is not None and hit[0] is tools:
            return hit[1]
        out = chat_tools(tools)
        if len(self._tools) > 10_000:
            self._tools.clear()
        self._tools[id(tools)] = (tools, out)
        return out

    def _cached(self, msg: Any, convert) -> list[dict]:
        hit = self._messages.get(id(msg))
        if hit is not None and hit[0] is msg:
            return hit[1]
        out = convert(msg)
        if len(self._messages) > 500_000:  # bound on huge runs; refills from live messages
            self._messages.clear()
        self._messages[id(msg)] = (msg, out)
        return out

    # -- Anthropic Messages ------------------------------------------------------------------

    def _messages_body(self, body: dict) -> list[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise UnreadableBody('a Messages body needs a "messages" list')
        out: list[dict] = []
        system = body.get("system")
        if system:
            hit = self._system.get(id(system))
            if hit is None or hit[0] is not system:
                hit = (system, {"role": "system", "content": text_of(system)})
                self._system[id(system)] = hit
            out.append(hit[1])
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise UnreadableBody(f"messages[{i}] is not an object")
            out.extend(self._cached(m, _anthropic_message))
        return out

    # -- OpenAI Responses --------------------------------------------------------------------

    def _responses_body(self, body: dict) -> list[dict]:
        out: list[dict] = []
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            out.append({"role": "system", "content": instructions})
        items = body.get("input")
        if isinstance(items, str):
            out.append({"role": "user", "content": items})
            return out
        if not isinstance(items, list):
            raise UnreadableBody('a Responses body needs "input" as a string or a list of items')
        reasoning: list[str] = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise UnreadableBody(f"input[{i}] is not an object")
            kind = item.get("type") or ("message" if "role" in item else None)
            if kind == "message":
                msg = {"role": str(item.get("role", "user")), "content": text_of(item.get("content"))}
                if msg["role"] == "assistant" and reasoning:
                    msg["reasoning_content"], reasoning = "".join(reasoning), []
                out.append(msg)
            elif kind == "function_call":
                call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                        "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}}
                last = out[-1] if out else None
                if last is not None and last.get("role") == "assistant" and not reasoning:
                    out[-1] = {**last, "tool_calls": [*last.get("tool_calls", []), call]}
                else:
                    msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                    if reasoning:
                        msg["reasoning_content"], reasoning = "".join(reasoning), []
                    out.append(msg)
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": output if isinstance(output, str) else text_of(output)})
            elif kind == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                reasoning.append(text_of(parts) if isinstance(parts, list) else str(parts))
            else:  # item_reference, server tool calls: opaque to a chat template
                out.append({"role": "user", "content": f"[{kind}]"})
        return out


def _anthropic_message(message: dict) -> list[dict]:
    """One Anthropic message -> one or more chat messages (as proxy/anthropic.py, leniently)."""
    role, content = str(message.get("role", "user")), message.get("content")
    if isinstance(content, str) or content is None:
        return [{"role": role, "content": content or ""}]
    if not isinstance(content, list):
        return [{"role": role, "content": text_of(content)}]
    out: list[dict] = []
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "thinking":
            reasoning.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue  # opaque to any template
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name", ""), "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        elif kind == "tool_result":
            if text:  # keep the order: text before the result stays before it
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = text_of(block.get("content", ""))
            if block.get("is_error"):
                result = f"[error] {result}"
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
        else:
            text.append(f"[{kind}]")
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif text or not out:
        out.append({"role": role, "content": "".join(text)})
    return out


# -- before the template --------------------------------------------------------------------


def _parsed_arguments(calls: list) -> list | None:
    """`calls` with JSON-text arguments parsed (None when nothing changes)."""
    changed = False
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:
                parsed = None  # not JSON: the template gets the text as sent
            if isinstance(parsed, dict):
                call = {**call, "function": {**fn, "arguments": parsed}}
                changed = True
        out.append(call)
    return out if changed else None


def template_content(content: Any) -> Any:
    """`content` as templates index it: None -> "", text parts joined; other shapes kept."""
    if content is None:
        return ""
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    return content


def template_message(msg: Any) -> Any:
    """A chat message as servers hand it to the chat template (module doc, point 2)."""
    if not isinstance(msg, dict):
        return msg
    out = None
    content = msg.get("content")
    fixed = template_content(content)
    if fixed is not content or "content" not in msg:
        out = dict(msg)
        out["content"] = fixed
    if msg.get("role") == "developer":
        out = out or dict(msg)
        out["role"] = "system"
    calls = msg.get("tool_calls")
    if isinstance(calls, list):
        if not calls:
            out = out or dict(msg)
            del out["tool_calls"]
        else:
            parsed = _parsed_arguments(calls)
            if parsed is not None:
                out = out or dict(msg)
                out["tool_calls"] = parsed
    return msg if out is None else out

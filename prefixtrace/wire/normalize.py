"""The analyzer's reading of any request body, and the server's own clean-up before the template.

Two jobs, both protocol-independent (no server, engine or FastAPI imports):

1. `ChatNormalizer.to_chat(body, endpoint)`: a chat-completions, Anthropic Messages or OpenAI
   Responses body as one chat-shaped request (`messages` with the system prompt first, chat-shaped
   `tools`, the parameters that decide the prompt). The translation itself is the protocol adapters'
   (prefixtrace/wire/messages.py, responses.py: the one the proxy applies before its engine renders),
   so the analyzer predicts the prompt the engine builds. What this adds is what an analysis of a
   long recording needs and a server does not:
   - speed: Messages bodies are translated message by message, cached by the identity of the
     source message. A recorded session resends its whole history every turn and the analyzer's
     loader makes unchanged messages the same objects from line to line, so each message is
     translated once and its translation is the same object in every later turn (which keeps the
     analyzer's per-message caches hitting);
   - leniency: a block the engine refuses (an image, a document) becomes a `[type]` text
     placeholder before translating, because an analysis must read what was sent, not judge it;
   - the client's own message indices (`SOURCE_INDEX`), so reports name `messages[2]` as sent.
   A body that is none of the three raises `UnreadableBody` with the reason.

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

from prefixtrace.common.errors import InvalidRequest
from prefixtrace.wire import messages as wire_messages
from prefixtrace.wire import responses as wire_responses

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "summary_text", "reasoning_text"})
API_CHAT, API_MESSAGES, API_RESPONSES = "chat", "messages", "responses"
# In a translated Messages body: for each chat message, the index of the source message in
# `messages` it came from (None for the top-level `system`). Reports name the client's own indices.
SOURCE_INDEX = "_source_index"
# Blocks the Messages adapter translates; any other becomes a text placeholder here.
_MESSAGES_BLOCKS = frozenset({"text", "thinking", "redacted_thinking", "tool_use", "tool_result"})


class UnreadableBody(ValueError):
    """The body is not a request of any API this module reads; the message says why."""


def api_of(body: Any, endpoint: str | None = None) -> str:
    """Which API a body belongs to: the endpoint's path when known, else its shape."""
    if not isinstance(body, dict):
        raise UnreadableBody(f"request body is a JSON {type(body).__name__}, not an object")
    path = (endpoint or "").split("?", 1)[0].rstrip("/")
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


def _placeholder(block: Any) -> dict:
    return {"type": "text", "text": f"[{block.get('type') if isinstance(block, dict) else type(block).__name__}]"}


def _renderable(message: dict) -> dict:
    """`message` with the blocks the Messages adapter refuses (images, documents, non-text tool
    results) replaced by text placeholders."""
    content = message.get("content")
    if not isinstance(content, list):
        return {**message, "content": text_of(content)}
    blocks = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in _MESSAGES_BLOCKS:
            block = _placeholder(block)
        elif kind == "tool_result" and isinstance(block.get("content"), list):
            block = {**block, "content": text_of(block["content"])}
        elif kind in ("text", "thinking") and not isinstance(block.get(kind), str):
            block = {**block, kind: text_of(block.get(kind))}
        blocks.append(block)
    return {**message, "content": blocks}


def chat_tool(tool: Any) -> Any:
    """An OpenAI-, Anthropic- or Responses-shaped tool in the chat shape the engine renders
    (the protocol adapters' translation), so that the same tool compares equal whichever API carried
    it; a tool that is none of these (a server tool such as web_search) is kept as it is."""
    if not isinstance(tool, dict) or isinstance(tool.get("function"), dict):
        return tool
    try:
        if "input_schema" in tool and isinstance(tool.get("name"), str):
            return wire_messages._translate_tool(tool, 0)
        if tool.get("type") == "function" and isinstance(tool.get("name"), str):
            return (wire_responses.to_chat_tools([tool]) or [tool])[0]
    except InvalidRequest:
        pass
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
        if api == API_RESPONSES:
            try:  # the adapter's translation, whole: Responses traffic is not the hot path
                return wire_responses.to_chat_body(_renderable_responses(body))
            except InvalidRequest as exc:
                raise UnreadableBody(f"not a readable Responses body: {exc.message}") from None
        try:
            out = wire_messages.to_chat_body({**body, "messages": [{"role": "user", "content": ""}],
                                              "system": None, "tools": None})
        except InvalidRequest as exc:
            raise UnreadableBody(f"not a readable Messages body: {exc.message}") from None
        sources: list[int | None] = []
        out["messages"] = self._messages_body(body, sources)
        out[SOURCE_INDEX] = sources
        if body.get("tools"):
            out["tools"] = self._chat_tools(body["tools"])
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

    def _messages_body(self, body: dict, sources: list) -> list[dict]:
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
            sources.append(None)
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise UnreadableBody(f"messages[{i}] is not an object")
            hit = self._messages.get(id(m))
            if hit is None or hit[0] is not m:
                hit = (m, _messages_message(m, i))
                if len(self._messages) > 500_000:  # bound on huge runs; refills from live messages
                    self._messages.clear()
                self._messages[id(m)] = hit
            out.extend(hit[1])
            sources.extend([i] * len(hit[1]))
        return out


def _messages_message(message: dict, i: int) -> list[dict]:
    """One Messages message as chat messages: the adapter's translation, leniently."""
    role = message.get("role")
    if role == "system":  # kept a system message, as the adapter does
        return [{"role": "system", "content": text_of(message.get("content"))}]
    if role not in ("user", "assistant"):
        raise UnreadableBody(f"messages[{i}].role must be 'user', 'assistant' or 'system', got {role!r}")
    try:
        return wire_messages._translate_message(message, i)
    except InvalidRequest:
        try:
            return wire_messages._translate_message(_renderable(message), i)
        except InvalidRequest as exc:
            raise UnreadableBody(exc.message) from None


def _renderable_responses(body: dict) -> dict:
    """A Responses body with parts the adapter refuses (images, files) replaced by text placeholders."""
    items = body.get("input")
    if not isinstance(items, list):
        return body
    out = []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("content"), list) and any(
                not (isinstance(p, dict) and (p.get("type") in TEXT_PART_TYPES or p.get("type") == "refusal"))
                for p in item["content"]):
            item = {**item, "content": text_of(item["content"])}
        out.append(item)
    return {**body, "input": out}


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

"""Anthropic's Messages API ↔ the wire model.

In: a Messages body becomes a chat-completions body (`to_chat_body`): top-level `system` first;
text, `tool_use` → `tool_calls`, `tool_result` → `tool` messages, `thinking` → the assistant's
`reasoning_content`; a `role: "system"` message inside `messages` (Claude Code sends one) stays a
system message, so the engine's mid-system policy decides where it goes, as on chat completions;
`cache_control` dropped (the prefix cache is automatic).

Out: `MessagesWriter` turns reply events into a Messages body or event stream; `MessagesReader`
turns a Messages event stream or body (an upstream's) back into reply events, so a turn is
recorded the same way whoever produced it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from prefixtrace.common.errors import InvalidRequest, PrefixtraceError, http_status
from prefixtrace.wire.events import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallStart, Usage

log = logging.getLogger("prefixtrace.wire")
PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
# Fields the engine reads (or that only a hosted API acts on and that change nothing here).
KNOWN_FIELDS = {"model", "messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stop_sequences",
                "stream", "tools", "tool_choice", "thinking", "metadata", "service_tier", "container", "mcp_servers"}
# stop_reason in the one vocabulary turns are recorded in (OpenAI's finish_reason, as ReplyDone has it);
# others (pause_turn, refusal) are kept as sent.
FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}
_logged_once: set[str] = set()


def finish_reason(stop_reason: Any) -> str | None:
    return FINISH_REASONS.get(stop_reason, stop_reason) if isinstance(stop_reason, str) else None


def to_anthropic_error(exc: PrefixtraceError) -> dict[str, Any]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(http_status(exc), "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message, "code": exc.code, **exc.details}}


def session_id(body: dict, headers: dict[str, str]) -> str | None:
    """The plain session id: Claude Code's `x-claude-code-session-id` header, else `session_id`
    inside a JSON-string `metadata.user_id`, else the `user_id` string itself."""
    lower = {k.lower(): v for k, v in (headers or {}).items()}
    if lower.get("x-claude-code-session-id"):
        return lower["x-claude-code-session-id"]
    metadata = body.get("metadata") if isinstance(body, dict) and isinstance(body.get("metadata"), dict) else {}
    user = metadata.get("user_id")
    if not isinstance(user, str) or not user:
        return None
    return plain_session_id(user)


def plain_session_id(user_id: str) -> str:
    """Claude Code's `metadata.user_id` is a JSON object whose `session_id` is the conversation (its
    device and account parts are the same for every conversation on a machine); any other id as it is."""
    if user_id.lstrip().startswith("{"):
        try:
            parsed = json.loads(user_id)
        except ValueError:
            return user_id
        if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str) and parsed["session_id"]:
            return parsed["session_id"]
    return user_id


def usage_counts(usage: dict) -> Usage:
    """An Anthropic usage object as the reply's counts (kept as sent in `turn.usage`):
    `prompt_tokens = input + cache read + cache creation`, `cached_tokens = cache read`."""
    read, created = usage.get("cache_read_input_tokens"), usage.get("cache_creation_input_tokens")
    prompt = usage["input_tokens"] + (read or 0) + (created or 0) if isinstance(usage.get("input_tokens"), int) else None
    completion = usage["output_tokens"] if isinstance(usage.get("output_tokens"), int) else None
    # Unknown stays None: an upstream that does not report cache reads is not a miss.
    return Usage(prompt, completion, read if isinstance(read, int) else None, as_sent=dict(usage))


def to_chat_body(body: dict) -> dict:
    """The chat-completions body the engine renders for a Messages body (InvalidRequest when it
    cannot be rendered)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty array", param="messages")
    chat: list[dict] = []
    system = text_of(body.get("system"), "system") if body.get("system") else ""
    if system:
        chat.append({"role": "system", "content": system})
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise InvalidRequest(f"messages[{i}].role must be 'user', 'assistant' or 'system'", param="messages")
        if message["role"] == "system":  # the engine's mid-system policy places it (docs/RENDER_POLICIES.md)
            chat.append({"role": "system", "content": text_of(message.get("content", ""), f"messages[{i}].content")})
            continue
        chat.extend(_translate_message(message, i))
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("'tools' must be an array", param="tools")
    out: dict[str, Any] = {
        "model": body.get("model"), "messages": chat, "stream": body.get("stream"),
        "max_tokens": body.get("max_tokens"), "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "stop": body.get("stop_sequences"),
    }
    if tools:
        out["tools"] = [_translate_tool(t, j) for j, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    kwargs = thinking_template_kwargs(body.get("thinking"))
    if kwargs is not None:
        out["chat_template_kwargs"] = kwargs
    output_config = body.get("output_config")
    if isinstance(output_config, dict) and isinstance(output_config.get("effort"), str):
        out["reasoning_effort"] = output_config["effort"]
    if isinstance(output_config, dict) and isinstance(output_config.get("format"), dict):
        fmt = output_config["format"]
        if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
            out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    _log_unused(body)
    return {k: v for k, v in out.items() if v is not None}


def thinking_template_kwargs(thinking: Any) -> dict | None:
    """What Messages' `thinking` tells the chat template (the engine's and the analyzer's renderer
    read it the same way): "adaptive" lets the model decide, so the template must allow thinking."""
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled", "adaptive"):
        return {"enable_thinking": thinking["type"] != "disabled"}
    return None


def _log_unused(body: dict) -> None:
    """Fields accepted but meaningless to a local engine (`context_management`, a newer API's
    additions) are named once per process, not refused: a harness must not break on them."""
    for key in body:
        if key not in KNOWN_FIELDS and key != "output_config" and key not in _logged_once:
            _logged_once.add(key)
            log.info("Messages field %r accepted and ignored by the embedded engine", key)


def _tool_choice(choice: Any) -> Any:
    """Anthropic's tool_choice in OpenAI's terms: auto, any → required, tool → that function, none."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                         param="tool_choice")


def text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
                parts.append(block["text"])
            else:
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise InvalidRequest(f"{where}: block of type {kind!r} is not supported here", param=where)
        return "".join(parts)
    raise InvalidRequest(f"{where} must be a string or an array of text blocks", param=where)


def _translate_message(message: dict, i: int) -> list[dict]:
    """One Anthropic message → one or more chat messages (tool results become `tool` messages)."""
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"messages[{i}].content must be a string or an array of blocks", param="messages")
    out: list[dict] = []
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        key = {"text": "text", "thinking": "thinking"}.get(kind)
        if key and not isinstance(block.get(key, ""), str):  # not rendered as "None" or a dict's repr
            raise InvalidRequest(f"messages[{i}]: a {kind} block's {key!r} must be a string", param="messages")
        if kind == "text":
            text.append(block.get("text", ""))
        elif kind == "thinking" and role == "assistant":
            reasoning.append(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue  # opaque to any template
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name", ""), "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if text:  # keep the order: text before the result stays before it
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = block.get("content", "")
            body = result if isinstance(result, str) else text_of(result, f"messages[{i}].tool_result")
            if block.get("is_error"):
                body = f"[error] {body}"
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": body})
        else:
            raise InvalidRequest(f"messages[{i}]: block of type {kind!r} is not supported by this engine",
                                 param="messages")
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _translate_tool(tool: Any, j: int) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise InvalidRequest(f"tools[{j}] must be an object with a 'name'", param="tools")
    # Key order as chat clients send it (name, description, parameters): templates dump tools as JSON,
    # so the same tool renders the same whichever API carried it (and as the analyzer renders it).
    fn: dict[str, Any] = {"name": tool["name"]}
    if tool.get("description"):
        fn["description"] = tool["description"]
    fn["parameters"] = tool.get("input_schema") or {"type": "object"}
    return {"type": "function", "function": fn}


class MessagesReader:
    """A Messages event stream (an upstream's, or a HAR's) → reply events for the turn. Usage and
    stop_reason stay in Anthropic's terms and are read by the caller (`usage_counts`)."""

    def __init__(self):
        self._tools: dict[int, int] = {}  # content block index → tool-call index

    def feed(self, data: dict):
        kind = data.get("type")
        if kind == "content_block_start":
            block = data.get("content_block") or {}
            if block.get("type") == "tool_use":
                index = self._tools[data.get("index", 0)] = len(self._tools)
                yield ToolCallStart(index, str(block.get("id") or ""), str(block.get("name") or ""))
                if block.get("input"):  # a block that arrives whole
                    yield ToolCallArgsDelta(index, json.dumps(block["input"], ensure_ascii=False))
            elif block.get("type") == "text" and block.get("text"):
                yield ContentDelta(block["text"])
        elif kind == "content_block_delta":
            delta = data.get("delta") or {}
            if delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                yield ContentDelta(delta["text"])
            elif delta.get("type") == "thinking_delta" and isinstance(delta.get("thinking"), str):
                yield ReasoningDelta(delta["thinking"])
            elif delta.get("type") == "input_json_delta" and data.get("index", 0) in self._tools:
                yield ToolCallArgsDelta(self._tools[data["index"]], str(delta.get("partial_json") or ""))

    def whole(self, body: dict):
        """The reply events of a non-streamed Messages body."""
        for block in body.get("content") or []:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text" and isinstance(block.get("text"), str):
                yield ContentDelta(block["text"])
            elif block.get("type") == "thinking" and isinstance(block.get("thinking"), str):
                yield ReasoningDelta(block["thinking"])
            elif block.get("type") == "tool_use":
                index = len(self._tools)
                self._tools[-1 - index] = index
                yield ToolCallStart(index, str(block.get("id") or ""), str(block.get("name") or ""))
                yield ToolCallArgsDelta(index, json.dumps(block.get("input", {}), ensure_ascii=False))

"""Anthropic's Messages API (`POST /v1/messages`), to the embedded engine or passed through upstream.

Embedded engine: the request is translated into the chat messages the engine
renders with the model's template (top-level `system` first; text, `tool_use`
→ `tool_calls`, `tool_result` → `tool` messages, `thinking` → the assistant's
`reasoning_content`; `cache_control` dropped: the prefix cache is automatic),
and the engine's events are written back as an Anthropic message or event
stream. Usage: `input_tokens` are the prompt tokens not served from the prefix
cache, `cache_read_input_tokens` those that were, `cache_creation_input_tokens`
is 0 (every prompt is cached automatically, at no extra cost).

Upstream: the body goes to the upstream's `/v1/messages` unchanged (with
`x-api-key` / `anthropic-version`); the response streams back event by event
and is parsed on the way into the recorded `Turn`, whose
`prompt_tokens = input + cache read + cache creation` and
`cached_tokens = cache_read_input_tokens` (None when the upstream did not say).

Recorded with endpoint "/v1/messages"; the body is stored as sent, so the
analyzer reads the Anthropic shape (top-level `system`, `cache_control`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request

from prefixtrace.errors import InvalidRequest, PrefixtraceError, http_status
from prefixtrace.wire.events import ContentDelta, ReasoningDelta, ReplyDone, ToolCallArgsDelta, ToolCallStart
from proxy import sse
from proxy.chat_request import ChatRequest, parse_chat_request
from proxy.relay import record_durably, serve_turn
from proxy.turn_builder import TurnBuilder
from proxy.upstream_backend import Relayed, map_httpx_errors

MESSAGES_PATH = "/v1/messages"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def to_anthropic_error(exc: PrefixtraceError) -> dict[str, Any]:
    """Anthropic's error body: {"type": "error", "error": {"type", "message"}}."""
    kind = ERROR_TYPES.get(http_status(exc), "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message, "code": exc.code, **exc.details}}


# --- translation ------------------------------------------------------------------


def to_chat_request(body: dict, headers: dict[str, str]) -> ChatRequest:
    """The engine's view of a Messages request; `body` stays the client's, for recording."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty array", param="messages")
    chat: list[dict] = []
    system = _text_of(body.get("system"), "system") if body.get("system") else ""
    if system:
        chat.append({"role": "system", "content": system})
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise InvalidRequest(f"messages[{i}].role must be 'user' or 'assistant'", param="messages")
        chat.extend(_translate_message(message, i))
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("'tools' must be an array", param="tools")
    openai_body: dict[str, Any] = {
        "model": body.get("model"), "messages": chat, "stream": body.get("stream"),  # parse_chat_request checks it
        "max_tokens": body.get("max_tokens"), "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "stop": body.get("stop_sequences"),
    }
    if tools:
        openai_body["tools"] = [_translate_tool(t, j) for j, t in enumerate(tools)]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled", "adaptive"):
        openai_body["chat_template_kwargs"] = {"enable_thinking": thinking["type"] != "disabled"}
    if body.get("tool_choice") is not None:
        openai_body["tool_choice"] = _translate_tool_choice(body["tool_choice"])
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    if isinstance(metadata.get("user_id"), str):
        openai_body["user"] = metadata["user_id"]
    req = parse_chat_request({k: v for k, v in openai_body.items() if v is not None}, headers)
    req.body = body
    return req


def _passthrough_request(body: dict, headers: dict[str, str]) -> ChatRequest:
    """Upstream mode: the body goes to the upstream as sent, so only what the proxy itself
    reads is checked here. Blocks the engine cannot render (images, documents, server-tool
    results) and the sampling fields are the upstream's to judge."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty array", param="messages")
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    user = metadata.get("user_id") if isinstance(metadata.get("user_id"), str) else None
    req = parse_chat_request({k: v for k, v in {"model": body.get("model"), "messages": messages,
                                                 "stream": body.get("stream"), "user": user}.items()
                              if v is not None}, headers)
    req.body = body
    return req


def _text_of(content: Any, where: str) -> str:
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
            body = result if isinstance(result, str) else _text_of(result, f"messages[{i}].tool_result")
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
    fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _translate_tool_choice(choice: Any) -> Any:
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


def record_usage(builder: TurnBuilder, usage: dict) -> None:
    """Fill the turn from an Anthropic usage object (kept as sent in `turn.usage`)."""
    turn = builder.turn
    read, created = usage.get("cache_read_input_tokens"), usage.get("cache_creation_input_tokens")
    if isinstance(usage.get("input_tokens"), int):
        turn.prompt_tokens = usage["input_tokens"] + (read or 0) + (created or 0)
    if isinstance(usage.get("output_tokens"), int):
        turn.completion_tokens = usage["output_tokens"]
    # Unknown stays None: an upstream that does not report cache reads is not a miss.
    turn.cached_tokens = read if isinstance(read, int) else None
    turn.usage = dict(usage)


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\n".encode() + sse.encode({"type": kind, **data})


# --- embedded engine --------------------------------------------------------------


class EngineMessages:
    """One Messages request served by the engine; wraps the engine's `EngineChat`."""

    status = 200

    def __init__(self, chat, req: ChatRequest, builder: TurnBuilder, tokenizer=None):
        self.chat, self.req, self.builder = chat, req, builder
        self.tokenizer = tokenizer  # to tell which stop sequence ended the output
        self.id = "msg_" + uuid.uuid4().hex
        self.model = req.model or chat.model

    @property
    def streams_events(self) -> bool:
        return self.req.stream

    def cancel(self) -> None:
        self.chat.cancel()

    def _usage(self, prompt: int, cached: int, output: int) -> dict:
        return {"input_tokens": prompt - cached, "output_tokens": output,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    def _message(self, content: list, stop_reason: str | None, usage: dict, stop_sequence: str | None = None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def _stop(self, finish_reason: str) -> tuple[str, str | None]:
        """Anthropic's (stop_reason, stop_sequence). The engine says "stop" for both EOS and a
        stop string; the output tokens tell which stop string it was (the emitted text never
        contains one, so the first one in the decoded output is the one that matched)."""
        stops = self.req.sampling.stop
        seq = getattr(self.chat, "seq", None)
        if finish_reason == "stop" and stops and self.tokenizer is not None and seq is not None:
            text = self.tokenizer.decode(list(seq.output_ids))
            hits = [(text.find(s), k) for k, s in enumerate(stops) if s in text]
            if hits:
                return "stop_sequence", stops[min(hits)[1]]
        return STOP_REASONS.get(finish_reason, "end_turn"), None

    async def sse(self) -> AsyncIterator[bytes]:
        """The engine's reply events as Messages stream events: a block per run of one kind (thinking,
        text, each tool_use), opened when its first event arrives."""
        seq = self.chat.seq
        # The first event came after admission, so the cached count is known here.
        start_usage = self._usage(seq.num_prompt_tokens, seq.num_cached_tokens, 0)
        yield _event("message_start", {"message": self._message([], None, start_usage)})
        blocks = _BlockWriter()
        async for event in self.chat.reply_events():
            if isinstance(event, ContentDelta):
                self.builder.on_chunk({"choices": [{"index": 0, "delta": {"content": event.text}}]})
                for out in blocks.text(event.text):
                    yield out
            elif isinstance(event, ReasoningDelta):
                self.builder.on_chunk({"choices": [{"index": 0, "delta": {"reasoning_content": event.text}}]})
                for out in blocks.thinking(event.text):
                    yield out
            elif isinstance(event, ToolCallStart):
                self.builder.on_chunk({"choices": [{"index": 0, "delta": {"tool_calls": [
                    {"index": event.index, "id": event.call_id, "function": {"name": event.name}}]}}]})
                for out in blocks.tool_use(event):
                    yield out
            elif isinstance(event, ToolCallArgsDelta):
                self.builder.on_chunk({"choices": [{"index": 0, "delta": {"tool_calls": [
                    {"index": event.index, "function": {"arguments": event.text}}]}}]})
                yield _event("content_block_delta", {"index": blocks.index, "delta": {
                    "type": "input_json_delta", "partial_json": event.text}})
            elif isinstance(event, ReplyDone):
                usage = self._usage(event.prompt_tokens, event.cached_tokens, event.completion_tokens)
                record_usage(self.builder, usage)
                self.builder.turn.finish_reason = event.finish_reason
                stop_reason, stop_sequence = self._stop(event.finish_reason)
                for out in blocks.close(empty_text=True):
                    yield out
                yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                               "usage": usage})
                yield _event("message_stop", {})

    async def whole(self) -> tuple[bytes, str]:
        from proxy.engine_backend import collect

        reply = await collect(self.chat.reply_events())
        done = reply.done
        content: list[dict] = []
        if reply.reasoning:
            content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
        if reply.text or not reply.tool_calls:
            content.append({"type": "text", "text": reply.text})
        for call in reply.tool_calls:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": _arguments_object(call["function"]["arguments"])})
        usage = self._usage(done.prompt_tokens, done.cached_tokens, done.completion_tokens)
        stop_reason, stop_sequence = self._stop(done.finish_reason)
        body = self._message(content, stop_reason, usage, stop_sequence)
        turn = self.builder.turn
        turn.response_text, turn.finish_reason = reply.text, done.finish_reason
        turn.reasoning_text = reply.reasoning
        turn.tool_calls = reply.tool_calls or None
        if done.completion_tokens:
            turn.ttft_s = self.chat.finished.prefill_s
        record_usage(self.builder, usage)
        return json.dumps(body).encode(), "application/json"


def _arguments_object(arguments: str) -> Any:
    """A tool_use block's `input` is an object; arguments the model wrote that are not one stay a string
    under "_raw" rather than being dropped (unconstrained calls are parsed, not validated)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_raw": arguments}


class _BlockWriter:
    """Messages content blocks, opened and closed as the reply's kind changes."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None  # "text" | "thinking" | "tool_use" while a block is open

    def _open(self, kind: str, block: dict) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.kind = kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self, empty_text: bool = False) -> list[bytes]:
        out = []
        if empty_text and self.index < 0:  # a reply with no output still has its (empty) text block
            out = self._open("text", {"type": "text", "text": ""})
        if self.kind is not None:
            if self.kind == "thinking":  # no signature: nothing here can verify one, so it is empty
                out.append(_event("content_block_delta", {"index": self.index, "delta": {
                    "type": "signature_delta", "signature": ""}}))
            out.append(_event("content_block_stop", {"index": self.index}))
            self.kind = None
        return out

    def text(self, text: str) -> list[bytes]:
        out = self._open("text", {"type": "text", "text": ""}) if self.kind != "text" else []
        return out + [_event("content_block_delta", {"index": self.index, "delta": {"type": "text_delta", "text": text}})]

    def thinking(self, text: str) -> list[bytes]:
        out = [] if self.kind == "thinking" else self._open("thinking", {"type": "thinking", "thinking": "",
                                                                          "signature": ""})
        return out + [_event("content_block_delta", {"index": self.index, "delta": {
            "type": "thinking_delta", "thinking": text}})]

    def tool_use(self, start: ToolCallStart) -> list[bytes]:
        return self._open("tool_use", {"type": "tool_use", "id": start.call_id, "name": start.name, "input": {}})


# --- upstream pass-through --------------------------------------------------------


class UpstreamMessages(Relayed):
    """An upstream's Messages response, passed through and parsed into the turn."""

    def __init__(self, response, builder: TurnBuilder, url: str):
        super().__init__(response, url)
        self.builder = builder
        self._usage: dict = {}
        self._tools: dict[int, dict] = {}

    async def sse(self) -> AsyncIterator[bytes]:
        try:
            with map_httpx_errors(self.url):
                async for event in sse.iter_events(self.response.aiter_lines()):
                    self._parse(sse.decode_data(event))
                    yield event
        finally:
            await self.response.aclose()
            if self._tools:
                self.builder.turn.tool_calls = [self._tools[i] for i in sorted(self._tools)]

    def _parse(self, data: dict | None) -> None:
        if not data:
            return
        kind, turn = data.get("type"), self.builder.turn
        if kind == "message_start":
            self._merge_usage((data.get("message") or {}).get("usage") or {})
        elif kind == "content_block_start":
            block = data.get("content_block") or {}
            if block.get("type") == "tool_use":
                self._tools[data.get("index", 0)] = {"id": block.get("id"), "type": "function",
                                                     "function": {"name": block.get("name", ""), "arguments": ""}}
        elif kind == "content_block_delta":
            delta = data.get("delta") or {}
            if delta.get("type") == "text_delta":
                self.builder.on_chunk({"choices": [{"index": 0, "delta": {"content": delta.get("text", "")}}]})
            elif delta.get("type") == "thinking_delta":
                self.builder.on_chunk({"choices": [{"index": 0, "delta": {"reasoning": delta.get("thinking", "")}}]})
            elif delta.get("type") == "input_json_delta" and data.get("index", 0) in self._tools:
                self._tools[data["index"]]["function"]["arguments"] += delta.get("partial_json", "")
                if turn.ttft_s is None:
                    turn.ttft_s = self.builder.elapsed()
        elif kind == "message_delta":
            turn.finish_reason = (data.get("delta") or {}).get("stop_reason") or turn.finish_reason
            self._merge_usage(data.get("usage") or {})
        elif kind == "error":
            turn.error = str(data.get("error"))[:2000]

    def _merge_usage(self, usage: dict) -> None:
        # message_delta counts are cumulative: they overwrite, and absent ones keep message_start's.
        self._usage.update({k: v for k, v in usage.items() if v is not None})
        record_usage(self.builder, self._usage)

    async def whole(self) -> tuple[bytes, str]:
        data, body = await self.read()
        turn = self.builder.turn
        if body is not None and self.status < 400:
            blocks = body.get("content") or []
            turn.response_text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
            turn.reasoning_text = "".join(b.get("thinking", "") for b in blocks if b.get("type") == "thinking")
            calls = [{"id": b.get("id"), "type": "function", "function": {
                "name": b.get("name", ""), "arguments": json.dumps(b.get("input", {}))}}
                for b in blocks if b.get("type") == "tool_use"]
            turn.tool_calls = calls or None
            turn.finish_reason = body.get("stop_reason")
            record_usage(self.builder, body.get("usage") or {})
        elif self.status >= 400:
            turn.error = (str(body.get("error", body)) if body is not None else data.decode(errors="replace"))[:2000]
        return data, self.content_type


async def open_messages(backend, req: ChatRequest, builder: TurnBuilder, headers: dict[str, str]):
    if hasattr(backend, "engine"):
        return EngineMessages(await backend.open(req, builder, headers), req, builder,
                              getattr(backend.engine, "tokenizer", None))
    response, url = await backend.post(MESSAGES_PATH, req.body, headers, session_id=req.session_id)
    return UpstreamMessages(response, builder, url)


# --- the route ----------------------------------------------------------------------


def add_messages_route(app: FastAPI, backend, recorder) -> None:
    """`POST /v1/messages`, ending like chat completions (`proxy.relay.respond`)."""

    @app.post(MESSAGES_PATH)
    async def messages(request: Request):
        return await serve_turn(request, endpoint=MESSAGES_PATH, upstream=backend.label, recorder=recorder,
                                parse=to_chat_request if hasattr(backend, "engine") else _passthrough_request,
                                open_reply=lambda req, builder, headers: open_messages(
                                    backend, req, builder, headers), stream=_stream, error_body=to_anthropic_error)


async def _stream(chat, builder: TurnBuilder, recorder):
    recorded = False
    try:
        async for event in chat.sse():
            if event.startswith(b"event: message_stop") and not recorded:
                # Commit before the client sees the end of the stream (as chat completions do).
                recorded = True
                await record_durably(recorder, builder.finish(chat.status))
            yield event
    except PrefixtraceError as exc:  # after the headers went out: tell the client in-band
        if not recorded:
            recorded = True
            await record_durably(recorder, builder.finish(chat.status, exc.message))
        yield _event("error", {"error": to_anthropic_error(exc)["error"]})
    except (asyncio.CancelledError, GeneratorExit):
        chat.cancel()
        if not recorded:
            recorded = True
            recorder.record(builder.finish(chat.status, "client disconnected"))
        raise
    finally:
        if not recorded:
            recorder.record(builder.finish(chat.status))

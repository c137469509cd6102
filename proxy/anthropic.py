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

import dataclasses
import json
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request

from prefixtrace.common.errors import InvalidRequest, PrefixtraceError
from prefixtrace.wire import messages as messages_wire
from prefixtrace.wire.events import ContentDelta, ReasoningDelta, ReplyDone, ToolCallArgsDelta, ToolCallStart, Usage
from recorder.turn_facts import SENT, ErrorText, Fact, Rendered, ReplyTokens, Served, Stop, WholeEvents
from prefixtrace.wire.messages import to_anthropic_error, usage_counts  # noqa: F401 (the route's error shape)
from prefixtrace.wire import sse
from proxy.upstream_query import with_query
from proxy.chat_request import ChatRequest, parse_chat_request
from proxy.backend import Backend, WholeReply
from proxy.relay import Framing, TurnSink, serve_turn
from proxy.upstream_backend import Relayed, map_httpx_errors, served_by

MESSAGES_PATH = messages_wire.PATH
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn", "tool_calls": "tool_use"}


# --- translation (prefixtrace/wire/messages.py) -----------------------------------


def to_chat_request(body: dict, headers: dict[str, str]) -> ChatRequest:
    """The engine's view of a Messages request; `body` stays the client's, for recording."""
    req = parse_chat_request(messages_wire.to_chat_body(body), headers)
    req.body = body
    req.session_id = messages_wire.session_id(body, headers) or req.session_id
    return req


def _passthrough_request(body: dict, headers: dict[str, str]) -> ChatRequest:
    """Upstream mode: the body goes to the upstream as sent, so only what the proxy itself
    reads is checked here. Blocks the engine cannot render (images, documents, server-tool
    results) and the sampling fields are the upstream's to judge."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty array", param="messages")
    req = parse_chat_request({k: v for k, v in {"model": body.get("model"), "messages": messages,
                                                 "stream": body.get("stream")}.items()
                              if v is not None}, headers)
    req.body = body
    req.session_id = messages_wire.session_id(body, headers) or req.session_id
    return req


def _event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\n".encode() + sse.encode({"type": kind, **data})


# --- embedded engine --------------------------------------------------------------


class EngineMessages:
    """One Messages request served by the engine; wraps the engine's `EngineChat`."""

    status = 200

    def __init__(self, chat, req: ChatRequest, tokenizer=None):
        self.chat, self.req = chat, req
        self.tokenizer = tokenizer  # to tell which stop sequence ended the output
        self.id = "msg_" + uuid.uuid4().hex
        self.model = req.model or chat.model

    @property
    def streams_events(self) -> bool:
        return self.req.stream

    url = None  # served here, by no upstream
    on_final = None  # the engine's turn is complete at its end marker

    @property
    def stage(self) -> str | None:
        return self.chat.stage  # the engine's stage of the chat this adapter wraps

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
        seq = self.chat.seq
        if finish_reason == "stop" and stops and self.tokenizer is not None and seq is not None:
            text = self.tokenizer.decode(list(seq.output_ids))
            hits = [(text.find(s), k) for k, s in enumerate(stops) if s in text]
            if hits:
                return "stop_sequence", stops[min(hits)[1]]
        return STOP_REASONS.get(finish_reason, "end_turn"), None

    async def sse(self) -> AsyncIterator[bytes | Fact]:
        """The engine's reply events as Messages stream events: a block per run of one kind (thinking,
        text, each tool_use), opened when its first event arrives; each reply event told to the turn
        before what it is written as."""
        seq = self.chat.seq
        # The first event came after admission, so the cached count is known here.
        start_usage = self._usage(seq.num_prompt_tokens, seq.num_cached_tokens, 0)
        yield _event("message_start", {"message": self._message([], None, start_usage)})
        blocks = _BlockWriter()
        async for event in self.chat.reply_events():
            if isinstance(event, ReplyDone):
                usage = self._usage(event.prompt_tokens, event.cached_tokens, event.completion_tokens)
                # The turn is recorded from the events the client is sent, the end with its usage as written.
                yield dataclasses.replace(event, usage=usage)
                stop_reason, stop_sequence = self._stop(event.finish_reason)
                for out in blocks.close(empty_text=True):
                    yield out
                yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                               "usage": usage})
                yield _event("message_stop", {})
                continue
            if isinstance(event, ReplyTokens):  # the engine's facts for the turn
                yield event
                continue
            yield SENT  # one point of the chunk timeline per reply event written
            yield event
            for out in blocks.write(event):
                yield out

    async def whole(self) -> WholeReply:
        reply = await self.chat.collect()
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
        # The same events, the end with its usage as written; TTFT is the engine's prefill when a token came.
        told = WholeEvents([*(e for e in reply.events if e is not done), dataclasses.replace(done, usage=usage)],
                           ttft_s=self.chat.finished.prefill_s if done.completion_tokens else None)
        return WholeReply(json.dumps(body).encode(), "application/json", [*reply.facts, told])


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

    def tool_arguments(self, delta: ToolCallArgsDelta) -> list[bytes]:
        return [_event("content_block_delta", {"index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": delta.text}})]

    def write(self, event) -> list[bytes]:
        """One reply event (not the end) as Messages stream events."""
        if isinstance(event, ContentDelta):
            return self.text(event.text)
        if isinstance(event, ReasoningDelta):
            return self.thinking(event.text)
        if isinstance(event, ToolCallStart):
            return self.tool_use(event)
        if isinstance(event, ToolCallArgsDelta):
            return self.tool_arguments(event)
        return []


# --- upstream pass-through --------------------------------------------------------


class UpstreamMessages(Relayed):
    """An upstream's Messages response, passed through and read into the turn: its content as
    reply events (`MessagesReader`, tool calls included), its usage and stop_reason as sent."""

    def __init__(self, response, url: str):
        super().__init__(response, url)
        self.reader = messages_wire.MessagesReader()
        self._usage: dict = {}

    async def sse(self) -> AsyncIterator[bytes | Fact]:
        """The events as they came, one item per upstream read (`sse.joined`), after what that read tells
        the turn; message_stop by itself."""
        try:
            with map_httpx_errors(self.url):
                async for batch in self.event_batches():
                    told: list[Fact] = []
                    for event in batch:
                        self.read_event(event, self._parse, told)  # one it cannot read is passed on, its fault told
                    for fact in told:
                        yield fact
                    for out in sse.joined(batch, _is_stop):
                        yield out
        finally:
            await self.response.aclose()

    def _parse(self, data: dict | None, told: list[Fact]) -> None:
        if not data:
            return
        kind = data.get("type")
        told.append(SENT)
        told.extend(self.reader.feed(data))
        if kind == "message_start":
            message = data.get("message") or {}
            if isinstance(message.get("diagnostics"), dict):  # cache diagnostics, kept beside the usage
                self._usage["diagnostics"] = message["diagnostics"]
            self._merge_usage(message.get("usage") or {}, told)
        elif kind == "message_delta":
            told.append(Stop(messages_wire.finish_reason((data.get("delta") or {}).get("stop_reason"))))
            self._merge_usage(data.get("usage") or {}, told)
        elif kind == "error":
            told.append(ErrorText(str(data.get("error"))[:2000]))

    def _merge_usage(self, usage: dict, told: list[Fact]) -> None:
        # message_delta counts are cumulative: they overwrite, and absent ones keep message_start's.
        self._usage.update({k: v for k, v in usage.items() if v is not None})
        told.append(usage_counts(self._usage))

    async def whole(self) -> WholeReply:
        data, body = await self.read()
        facts: list[Fact] = []
        if body is not None and self.status < 400:
            with self.reading(body, "content"):  # a body of the wrong shape: a 502 naming the upstream's fault
                facts.append(WholeEvents(list(self.reader.whole(body))))
                facts.append(Stop(messages_wire.finish_reason(body.get("stop_reason"))))
                diagnostics = {"diagnostics": body["diagnostics"]} if isinstance(body.get("diagnostics"), dict) else {}
                facts.append(usage_counts({**(body.get("usage") or {}), **diagnostics}))
        elif self.status >= 400:
            facts.append(ErrorText(self.error_text(data, body)))
        return WholeReply(data, self.content_type, facts)


async def open_messages(backend: Backend, req: ChatRequest, headers: dict[str, str], learnt: list[Fact]):
    if backend.embedded:
        return EngineMessages(await backend.open(req, headers, learnt), req, backend.engine.tokenizer)
    response, url = await backend.post(with_query(MESSAGES_PATH, req.query), req.body, headers, session_id=req.session_id, raw=req.raw)
    learnt.append(Served(served_by(response, url)))  # the worker behind a router, else `url`
    return UpstreamMessages(response, url)


# --- the route ----------------------------------------------------------------------


def add_messages_route(app: FastAPI, backend: Backend, recorder: TurnSink) -> None:
    """`POST /v1/messages`, ending like chat completions (`proxy.relay.respond`)."""

    @app.post(MESSAGES_PATH)
    async def messages(request: Request):
        return await serve_turn(request, endpoint=MESSAGES_PATH, backend=backend, recorder=recorder,
                                parse=to_chat_request if backend.embedded else _passthrough_request,
                                open_reply=lambda req, headers, learnt: open_messages(backend, req, headers, learnt),
                                framing=FRAMING, error_body=to_anthropic_error)

    @app.post(messages_wire.COUNT_TOKENS_PATH)
    async def count_tokens(request: Request):
        return await serve_turn(request, endpoint=messages_wire.COUNT_TOKENS_PATH, backend=backend,
                                recorder=recorder,
                                parse=to_chat_request if backend.embedded else _passthrough_request,
                                open_reply=lambda req, headers, learnt: open_count(backend, req, headers, learnt),
                                framing=FRAMING, error_body=to_anthropic_error)


class TokenCount:
    """`POST /v1/messages/count_tokens` on the engine: the prompt the engine would render for
    this body (template, tools and render policies included), counted; nothing is generated."""

    status = 200
    streams_events = False
    url = None
    on_final = None
    stage = None  # counted at once: no stage a client could leave in

    def __init__(self, count: int):
        self.count = count

    def cancel(self) -> None:
        pass

    async def whole(self) -> WholeReply:
        return WholeReply(json.dumps({"input_tokens": self.count}).encode(), "application/json", [])


async def open_count(backend: Backend, req: ChatRequest, headers: dict[str, str], learnt: list[Fact]):
    if not backend.embedded:
        response, url = await backend.post(with_query(messages_wire.COUNT_TOKENS_PATH, req.query), req.body, headers,
                                           session_id=req.session_id, raw=req.raw)
        return UpstreamCount(response, url)
    req.stream = False
    rendered = await backend.render(req, count_only=True)
    learnt.append(Rendered(len(rendered.text), len(rendered.token_ids)))
    learnt.append(Usage(len(rendered.token_ids), None, None))  # counted, nothing generated
    return TokenCount(len(rendered.token_ids))


class UpstreamCount(Relayed):
    """An upstream's count, passed through; its number kept as the turn's prompt tokens."""

    @property
    def streams_events(self) -> bool:
        return False

    async def whole(self) -> WholeReply:
        data, body = await self.read()
        facts: list[Fact] = []
        if body is not None and self.status < 400 and isinstance(body.get("input_tokens"), int):
            facts.append(Usage(body["input_tokens"], None, None))  # the upstream's count
        elif self.status >= 400:
            facts.append(ErrorText(data[:2000].decode(errors="replace")))
        return WholeReply(data, self.content_type, facts)


def _is_stop(event: bytes) -> bool:
    return event.startswith(b"event: message_stop")  # what the turn is committed before


def _in_band_error(exc: PrefixtraceError) -> list[bytes]:
    return [_event("error", {"error": to_anthropic_error(exc)["error"]})]


# Every streamed Messages reply: committed before message_stop, errors as an `error` event.
FRAMING = Framing(_is_stop, _in_band_error)

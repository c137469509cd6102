"""OpenAI's Responses API (`POST /v1/responses`), to the embedded engine or passed through upstream.

Embedded engine: the request is translated into chat messages (prefixtrace/wire/responses.py) and
rendered like any other; the engine's reply events are written back as a Response object or its
event stream (prefixtrace/wire/responses_stream.py). `store` (true unless the client says false,
as on OpenAI) keeps the conversation in memory under the response id so that a later request can
continue it with `previous_response_id`; an id this process does not hold (never stored, stored
with `store: false`, or from before a restart) is a 400 naming it; `GET /v1/responses/{id}` returns
a stored Response object (404 in OpenAI's shape for any other id). Nothing stored here outlives
the process: the recorder has every turn. A streamed reply says `response.created` and
`response.in_progress` as soon as the request is accepted, before prefill; `parallel_tool_calls:
false` keeps at most the reply's first call.

Upstream: the body goes to the upstream's `/v1/responses` unchanged (the upstream owns
`previous_response_id`), the stream passes through event by event and is read back into reply
events for the recorded turn.

Recorded with endpoint "/v1/responses"; usage: `prompt_tokens = input_tokens`,
`cached_tokens = input_tokens_details.cached_tokens` (None when the upstream did not say).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from prefixtrace.common.errors import (InvalidRequest, PrefixtraceError, UnknownEndpoint, UpstreamError, http_status,
                           to_openai_error)
from prefixtrace.wire import responses as wire
from prefixtrace.wire import sse
from prefixtrace.wire.events import ContentDelta, ReasoningDelta, ReplyDone, Usage
from prefixtrace.wire.responses_stream import TERMINAL, ResponsesReader, ResponsesWriter, encode
from recorder.turn_facts import SENT, ErrorText, Fact, ReplyTokens, Served, WholeEvents
from proxy.upstream_query import with_query
from proxy.chat_request import ChatRequest, parse_chat_request, passthrough_request
from proxy.backend import Backend, WholeReply
from proxy.relay import Framing, TurnSink, serve_turn
from proxy.upstream_backend import Relayed, map_httpx_errors, served_by

RESPONSES_PATH = wire.PATH
STORE_LIMIT = 1024  # conversations kept for previous_response_id (oldest dropped first)


class ResponseNotFound(UnknownEndpoint):
    """`GET /v1/responses/{id}` of a response this process does not hold: 404, in OpenAI's shape."""
    code = "not_found"


class ResponseStore:
    """Conversations (chat messages, instructions excluded) by response id, newest kept, and the
    Response objects themselves for `GET /v1/responses/{id}`."""

    def __init__(self, limit: int = STORE_LIMIT):
        self.limit = limit
        self._items: OrderedDict[str, list[dict]] = OrderedDict()
        self._responses: dict[str, dict] = {}

    def get(self, response_id: str) -> list[dict]:
        if response_id not in self._items:
            raise InvalidRequest(f"previous response {response_id!r} is not stored here (it was sent with "
                                 "store: false, or before this server restarted); send the whole input instead",
                                 param="previous_response_id")
        self._items.move_to_end(response_id)
        return self._items[response_id]

    def put(self, response_id: str, messages: list[dict], response: dict | None = None) -> None:
        self._items[response_id] = messages
        if response is not None:
            self._responses[response_id] = response
        while len(self._items) > self.limit:
            dropped, _ = self._items.popitem(last=False)
            self._responses.pop(dropped, None)

    def response(self, response_id: str) -> dict:
        if response_id not in self._responses:
            raise ResponseNotFound(f"Response with id {response_id!r} not found (only responses this server "
                                   "made with store: true, since it started, are kept)", param="response_id")
        return self._responses[response_id]


def _conversation(req: ChatRequest) -> list[dict]:
    """The request's conversation without the instructions (they do not carry over)."""
    messages = req.messages
    if req.body.get("instructions"):
        messages = messages[1:]
    return list(messages)


class EngineResponses:
    """One Responses request served by the engine; wraps the engine's `EngineChat`. Each event it writes
    is a point of the turn's timeline (`SENT`, before its bytes)."""

    status = 200

    def __init__(self, chat, req: ChatRequest, store: ResponseStore):
        self.chat, self.req, self.store = chat, req, store
        self.writer = ResponsesWriter(req.body, req.model or chat.model)
        self._text: list[str] = []  # the reply as sent, for the stored conversation
        self._reasoning: list[str] = []

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

    def _on(self, event, told: list[Fact]) -> list[dict]:
        """The Responses events `event` is written as; what it tells the turn added to `told`."""
        if isinstance(event, ReplyTokens):  # the engine's facts for the turn
            told.append(event)
            return []
        if not self.writer.accepts(event):  # a second call under parallel_tool_calls: false: not sent, not recorded
            return []
        told.append(event)
        if isinstance(event, ContentDelta):
            self._text.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self._reasoning.append(event.text)
        out = self.writer.feed(event)
        if isinstance(event, ReplyDone):  # the usage object the writer sent, with the event's own counts
            told.append(Usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens,
                              as_sent=self.writer.usage))
            self._keep()
        return out

    def _keep(self) -> None:
        if self.req.body.get("store") is False:
            return
        reply: dict = {"role": "assistant", "content": "".join(self._text)}
        if self._reasoning:
            reply["reasoning_content"] = "".join(self._reasoning)
        calls = [item for item in self.writer.output if item["type"] == "function_call"]
        if calls:
            reply["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        response = json.loads(json.dumps(self.writer.response()))  # a copy: the writer's items stay its own
        self.store.put(self.writer.id, _conversation(self.req) + [reply], response)

    async def sse(self) -> AsyncIterator[bytes | Fact]:
        for event in self.writer.start():
            yield SENT
            yield encode(event)
        try:
            async for reply in self.chat.reply_events():
                told: list[Fact] = []
                out = self._on(reply, told)
                for fact in told:
                    yield fact
                for event in out:
                    yield SENT
                    yield encode(event)
        except PrefixtraceError as exc:
            yield ErrorText(exc.message)
            for event in self.writer.fail(exc.code or "server_error", exc.message):
                yield SENT
                yield encode(event)

    async def whole(self) -> WholeReply:
        told: list[Fact] = []
        async for reply in self.chat.reply_events():
            self._on(reply, told)
        return WholeReply(json.dumps(self.writer.response(), ensure_ascii=False).encode(), "application/json", told)


class UpstreamResponses(Relayed):
    """An upstream's Responses reply, passed through and read into the turn."""

    def __init__(self, response, url: str):
        super().__init__(response, url)
        self.reader = ResponsesReader()
        self._complete = False  # a terminal event or an in-band error seen

    def _on(self, data: dict, told: list[Fact]) -> None:
        self._complete = self._complete or data.get("type") in (*TERMINAL, "error")
        told.extend(self.reader.feed(data))  # a terminal event's ReplyDone carries its usage as sent
        if data.get("type") in TERMINAL:
            response = data.get("response") or {}
            if response.get("error"):
                told.append(ErrorText(str(response["error"])[:2000]))
        elif data.get("type") == "error":
            told.append(ErrorText(str(data.get("message") or data)[:2000]))

    async def sse(self) -> AsyncIterator[bytes | Fact]:
        """The events as they came, one item per upstream read (`sse.joined`), after what that read tells
        the turn (each event a point of its timeline); a terminal one by itself."""
        try:
            with map_httpx_errors(self.url):
                async for batch in self.event_batches():
                    told: list[Fact] = []
                    for event in batch:
                        self.read_event(event, self._on, told)  # one it cannot read is passed on, its fault told
                    for fact in told:
                        yield fact
                    for out in sse.joined(batch, _is_terminal):
                        for _ in range(out.count(b"\n\n")):
                            yield SENT
                        yield out
        finally:
            await self.response.aclose()
        if not self._complete:  # cut short: only the protocol's own end marks tell (as on chat completions)
            raise UpstreamError(f"the stream from {self.url} ended without response.completed (cut short?)")

    async def whole(self) -> WholeReply:
        data, body = await self.read()
        facts: list[Fact] = []
        if body is not None and self.status < 400:
            with self.reading(body, "output"):  # a body of the wrong shape: a 502 naming the upstream's fault
                facts.append(WholeEvents(list(self.reader.whole(body))))  # its ReplyDone carries the usage as sent
        elif self.status >= 400:
            facts.append(ErrorText(self.error_text(data, body)))
        return WholeReply(data, self.content_type, facts)


def add_responses_route(app: FastAPI, backend: Backend, recorder: TurnSink) -> None:
    """`POST /v1/responses`, ending like chat completions (`proxy.relay.respond`)."""
    store = ResponseStore()
    on_engine = backend.embedded

    def parse(body: dict, headers: dict[str, str]) -> ChatRequest:
        if on_engine:
            previous_id = body.get("previous_response_id")
            if previous_id is not None and not isinstance(previous_id, str):
                raise InvalidRequest("'previous_response_id' must be a string", param="previous_response_id")
            previous = store.get(previous_id) if previous_id else None
            req = parse_chat_request(wire.to_chat_body(body, previous), headers)
        else:  # the upstream judges the body; only what the proxy reads is checked
            wire.input_items(body)
            return passthrough_request(body, wire.session_id(body, headers))
        req.body = body
        req.session_id = wire.session_id(body, headers)
        return req

    async def open_reply(req: ChatRequest, headers: dict[str, str], learnt: list[Fact]):
        if on_engine:
            # Streamed: the headers and response.created go out before prefill (a client's idle timeout
            # counts from the request), and an engine failure after that is response.failed in-band.
            chat = await backend.open(req, headers, learnt, wait_first=not req.stream)
            return EngineResponses(chat, req, store)
        response, url = await backend.post(with_query(RESPONSES_PATH, req.query), req.body, headers, session_id=req.session_id,
                                           raw=req.raw)
        learnt.append(Served(served_by(response, url)))  # the worker behind a router, else `url`
        return UpstreamResponses(response, url)

    @app.post(RESPONSES_PATH)
    async def responses(request: Request):
        return await serve_turn(request, endpoint=RESPONSES_PATH, backend=backend, recorder=recorder,
                                parse=parse, open_reply=open_reply, framing=FRAMING, error_body=to_openai_error)

    @app.get(RESPONSES_PATH + "/{response_id}")
    async def retrieve(response_id: str):
        """A stored Response object (not a model turn: not recorded). With --upstream the upstream
        holds its own responses; this proxy keeps none, so the answer is the same 404."""
        try:
            return JSONResponse(store.response(response_id))
        except ResponseNotFound as exc:
            return JSONResponse(to_openai_error(exc), status_code=http_status(exc))


def _is_terminal(event: bytes) -> bool:
    first = event.split(b"\n", 1)[0]
    return first.startswith(b"event:") and first[6:].strip().decode(errors="replace") in TERMINAL


def _in_band_error(exc: PrefixtraceError) -> list[bytes]:
    return [encode({"type": "error", "sequence_number": 0, "code": exc.code, "message": exc.message, "param": None})]


# Every streamed Responses reply: committed before its terminal event, errors as an `error` event.
FRAMING = Framing(_is_terminal, _in_band_error)

"""OpenAI's chat completions (`POST /v1/chat/completions`), to the embedded engine or passed through upstream.

Embedded engine: the request is parsed here (`parse_chat_request`, proxy/chat_request.py, which
the other adapters translate into) and the engine's reply events are written as
chat.completion(.chunk) objects (`EngineChatCompletion`). Upstream: the body goes on as sent, with
`stream_options.include_usage` added to a streamed request that lacks it so every turn has its
usage (the client sees the usage chunk only if it asked), and each chunk is read into the turn
on its way back (`UpstreamChat`). Legacy completions upstream are relayed the same way
(proxy/completions.py), their chunks carrying `text`.

A stream ends the same way on both: the turn committed before `data: [DONE]` goes out
(`stream`, proxy/relay.py `stream_and_record`), a failure after the headers sent as an OpenAI
error chunk and then `[DONE]`.

Recorded with endpoint "/v1/chat/completions".
"""

from __future__ import annotations

import json
import uuid
from typing import AsyncIterator, Callable

import httpx
from fastapi import FastAPI, Request

from prefixtrace.common.errors import PrefixtraceError, UpstreamError, to_openai_error
from prefixtrace.wire import sse
from prefixtrace.wire.events import ContentDelta, ReasoningDelta, ReplyDone, ToolCallArgsDelta, ToolCallStart, Usage
from prefixtrace.wire.http import map_httpx_errors
from recorder.turn_facts import (ChatBody, ChatChunk, ChoicePiece, ErrorText, Fact, Served, SENT, ToolCallPiece)
from proxy.upstream_query import with_query
from proxy.backend import Backend, ForwardingBackend, WholeReply
from proxy.chat_request import ChatRequest, parse_chat_request
from proxy.relay import Framing, TurnSink, serve_turn
from proxy.upstream_backend import UNREADABLE, Relayed, plain_json_object, served_by

CHAT_PATH = "/v1/chat/completions"
USAGE_OPTION = b'"stream_options":{"include_usage":true}'


def is_done(event: bytes) -> bool:
    """The end of an OpenAI stream (chat and legacy completions): the turn is committed before it."""
    return event == sse.DONE


def in_band_error(exc: PrefixtraceError) -> list[bytes]:
    """A failure after the headers went out, as OpenAI streams one: an error chunk, then [DONE]."""
    return [sse.encode(to_openai_error(exc)), sse.DONE]


# How an OpenAI stream ends (proxy/relay.py `stream_and_record`): chat and legacy completions alike.
FRAMING = Framing(is_done, in_band_error)


# --- the route ----------------------------------------------------------------------


def add_chat_route(app: FastAPI, backend: Backend, recorder: TurnSink) -> None:
    """`POST /v1/chat/completions`, ended by `proxy.relay.respond`."""

    async def open_reply(req: ChatRequest, headers: dict[str, str], learnt: list[Fact]):
        if backend.embedded:
            return EngineChatCompletion(await backend.open(req, headers, learnt), req)
        return await open_upstream(backend, req, headers, learnt)

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request):
        return await serve_turn(request, endpoint=CHAT_PATH, backend=backend, recorder=recorder,
                                parse=parse_chat_request, open_reply=open_reply, framing=FRAMING,
                                error_body=to_openai_error)


# --- embedded engine --------------------------------------------------------------


class EngineChatCompletion:
    """One chat request served by the engine; wraps the engine's `EngineChat`. Each chunk it writes
    goes to the turn as sent (`ChatChunk`), just before its bytes."""

    status = 200

    def __init__(self, chat, req: ChatRequest):
        self.chat, self.req = chat, req
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = chat.created
        self.model = chat.model

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

    async def sse(self) -> AsyncIterator[bytes | Fact]:
        """The reply as chat.completion.chunk objects, each after the fact it tells the turn: the chunk
        as the turn reads it (`ChatChunk`), made from the same values the chunk is written from."""
        yield chunk_fact(ChoicePiece("", None, [], None))
        yield self._chunk({"role": "assistant", "content": ""})
        try:
            async for event in self.chat.reply_events():
                if isinstance(event, ContentDelta):
                    yield chunk_fact(ChoicePiece(event.text, None, [], None))
                    yield self._chunk({"content": event.text})
                elif isinstance(event, ReasoningDelta):
                    yield chunk_fact(ChoicePiece(None, event.text, [], None))
                    yield self._chunk({"reasoning_content": event.text})
                elif isinstance(event, ToolCallStart):
                    yield chunk_fact(ChoicePiece(None, None, [ToolCallPiece(event.index, event.call_id, event.name, "")],
                                                 None))
                    yield self._chunk({"tool_calls": [{"index": event.index, "id": event.call_id, "type": "function",
                                                       "function": {"name": event.name, "arguments": ""}}]})
                elif isinstance(event, ToolCallArgsDelta):
                    yield chunk_fact(ChoicePiece(None, None, [ToolCallPiece(event.index, None, None, event.text)], None))
                    yield self._chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
                elif isinstance(event, ReplyDone):
                    usage = usage_of(event)
                    counts = counts_of(event, usage)
                    yield counts
                    yield chunk_fact(ChoicePiece(None, None, [], event.finish_reason))
                    yield self._chunk({}, finish_reason=event.finish_reason)
                    if self.req.include_usage:
                        yield ChatChunk([], counts)
                        yield sse.encode({**self._envelope(), "choices": [], "usage": usage})
                else:  # the engine's facts for the turn (`ReplyTokens`)
                    yield event
        except PrefixtraceError as err:  # after the headers went out: in band
            body = to_openai_error(err)
            yield ErrorText(body["error"]["message"])
            yield sse.encode(body)
        yield sse.DONE

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse.encode({**self._envelope(), "choices": [choice]})

    def _envelope(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}

    async def whole(self) -> WholeReply:
        body, facts = await self.json()
        return WholeReply(json.dumps(body).encode(), "application/json", facts)

    async def json(self) -> tuple[dict, list[Fact]]:
        """The chat.completion body, and the facts it tells its turn."""
        reply = await self.chat.collect()
        message: dict = {"role": "assistant", "content": reply.text if reply.text or not reply.tool_calls else None}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = reply.tool_calls
        done = reply.done
        body = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": done.finish_reason}],
            "usage": usage_of(done),
        }
        # TTFT as the engine measured it: its prefill (no token went out apart from the body).
        ttft = self.chat.finished.prefill_s if done.completion_tokens else None
        told = ChatBody(True, reply.text or "", reply.reasoning or "", reply.tool_calls or None, done.finish_reason,
                        counts_of(done, body["usage"]), ttft)
        return body, [*reply.facts, told]


def chunk_fact(piece: ChoicePiece) -> ChatChunk:
    """The fact of one chunk of the engine's, whose only choice carries `piece` and no usage."""
    return ChatChunk([piece], None)


def counts_of(event: ReplyDone, usage: dict) -> Usage:
    """The counts of `usage` (`usage_of(event)`), as the turn keeps them: the usage object as sent."""
    return Usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens, as_sent=usage)


def usage_of(event: ReplyDone) -> dict:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens},
    }


# --- upstream pass-through --------------------------------------------------------


async def open_upstream(backend: ForwardingBackend, req: ChatRequest, headers: dict[str, str], learnt: list[Fact],
                        *, path: str = CHAT_PATH) -> UpstreamChat:
    """Chat completions, or (`path`) legacy completions, whose chunks carry `text`, POSTed upstream."""
    body, raw = req.body, req.raw
    options = body.get("stream_options")
    if req.stream and not (isinstance(options, dict) and options.get("include_usage") is True):
        # Ask for usage so every turn can be recorded; the client only sees
        # the usage chunk if it asked for it itself.
        body = {**body, "stream_options": {**(options or {}), "include_usage": True}}
        # The client's bytes with the option added, when it had none (no re-encoding).
        raw = _with_member(raw, USAGE_OPTION) if "stream_options" not in req.body and req.body else None
    response, url = await backend.post(with_query(path, req.query), body, headers, session_id=req.session_id, raw=raw)
    learnt.append(Served(served_by(response, url)))  # a router's worker names itself
    return UpstreamChat(req, response, url)


def _with_member(raw: bytes | None, member: bytes) -> bytes | None:
    """`raw`, a non-empty JSON object without `member`'s key, with `member` added at its end."""
    if raw is None or not plain_json_object(raw):
        return None
    return raw.rstrip(b" \t\r\n")[:-1] + b"," + member + b"}"


class UpstreamChat(Relayed):
    """An upstream's chat (or legacy) completion, passed through and read into the turn: every
    chunk told to the turn as it passes (`ChatChunk`), the usage chunk the proxy asked for kept from a
    client that did not."""

    def __init__(self, req: ChatRequest, response: httpx.Response, url: str):
        super().__init__(response, url)
        self.req = req
        self._complete = False  # [DONE], a finish_reason or an in-band error seen
        # Called once the turn can take nothing more but [DONE]: the usage chunk after a
        # finish_reason (the last one OpenAI streams). The upstream commits its own turn before
        # it sends [DONE]; starting ours here overlaps the two commits (issue 17).
        self.on_final: Callable[[], None] | None = None
        self._final = False

    async def sse(self) -> AsyncIterator[bytes | Fact]:
        """What the client is sent, one item per upstream read (`sse.joined`), after the facts that
        read's events tell the turn; [DONE] by itself."""
        try:
            with map_httpx_errors(self.url):
                async for batch in self.event_batches():
                    told: list[Fact] = []
                    was_final = self._final
                    passed = [out for out in (self._pass(event, told) for event in batch) if out]
                    for fact in told:
                        yield fact
                    if self._final and not was_final:  # every fact of the turn is told: it may commit now
                        self.on_final()
                    for out in sse.joined(passed, is_done):
                        yield out
        finally:
            await self.response.aclose()
        if not self._complete:
            # A stream framed by closing the connection (no chunked encoding, no length)
            # that is cut short reads like one that ended: only the protocol's own end
            # marks tell them apart.
            raise UpstreamError(f"the stream from {self.url} ended without [DONE] or a finish_reason "
                                "(cut short?)")

    def _pass(self, event: bytes, told: list[Fact]) -> bytes | None:
        """`event` as the client gets it (None: not passed on), what it tells the turn added to `told`."""
        chunk = sse.decode_data(event)
        if chunk is None:
            if sse.is_done(event):
                self._complete = True
            elif sse.unreadable(event):
                told.append(self.fault("data that is not a JSON object", event))
            return event
        if self._final:
            # Data after the final usage chunk: the turn is already with the recorder, which
            # may be writing it right now; it is passed on, not recorded (a broken upstream).
            return event
        choices = chunk.get("choices") or ()
        if "error" in chunk:
            self._complete = True
        elif choices and not self._complete:
            for choice in choices:
                if isinstance(choice, dict) and choice.get("finish_reason"):
                    self._complete = True
                    break
        try:
            told.append(ChatChunk.read(chunk))
        except UNREADABLE as exc:
            told += [SENT, self.fault(str(exc), event)]  # its point on the timeline all the same
            return event
        if "error" in chunk and not chunk.get("choices"):
            told.append(ErrorText(str(chunk["error"])))
        usage_only = not choices and chunk.get("usage")
        if usage_only and self._complete and "error" not in chunk and self.on_final is not None:
            self._final = True
        if usage_only and not self.req.include_usage:
            return None
        return event

    async def whole(self) -> WholeReply:
        """The whole body (non-streamed requests and upstream errors), and what it tells the turn."""
        data, body = await self.read()
        facts: list[Fact] = []
        if body is not None:
            if self.status < 400:
                with self.reading(body, "choices"):
                    facts.append(ChatBody.read(body))
            else:
                facts.append(ErrorText(str(body.get("error", body))[:2000]))
        elif self.status >= 400:
            facts.append(ErrorText(data[:2000].decode(errors="replace")))
        return WholeReply(data, self.content_type, facts)

"""OpenAI's legacy completions (`POST /v1/completions`): a raw prompt, no chat template.

Embedded engine: the prompt string is tokenized as it is (`EngineBackend.open_prompt`) and the
engine's reply events are written as `text_completion` objects or chunks (a usage chunk when
`stream_options.include_usage` asks, then `data: [DONE]`). Upstream: passed through like chat
completions (`proxy.chat_completions.open_upstream`), the chunks' `text` read into the turn.
Recorded with endpoint "/v1/completions".
"""

from __future__ import annotations

import json
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request

from prefixtrace.common.errors import InvalidRequest, to_openai_error
from prefixtrace.wire import completions as wire
from prefixtrace.wire import sse
from prefixtrace.wire.events import ContentDelta, ReplyDone
from recorder.turn_facts import SENT, Fact
from proxy.chat_request import ChatRequest, parse_chat_request
from proxy.backend import Backend, WholeReply
from proxy.chat_completions import FRAMING, counts_of, open_upstream
from proxy.relay import TurnSink, serve_turn

COMPLETIONS_PATH = wire.PATH


def parse_completion_request(body: dict, headers: dict[str, str]) -> ChatRequest:
    """The prompt and the sampling fields (read as on chat completions); what the engine cannot do
    (echo, logprobs, best_of, suffix) is a 400 naming it rather than silently different output."""
    prompt = wire.prompt_of(body)
    for key, off in (("echo", False), ("logprobs", None), ("suffix", None), ("best_of", 1)):
        if body.get(key, off) not in (off, None):
            raise InvalidRequest(f"'{key}' is not supported by the embedded engine", param=key)
    req = parse_chat_request({**body, "messages": [{"role": "user", "content": prompt}]}, headers)
    req.messages, req.body = [], body
    return req


class EngineCompletion:
    """One completions request served by the engine; wraps the engine's `EngineChat`."""

    status = 200

    def __init__(self, chat, req: ChatRequest):
        self.chat, self.req = chat, req
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
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

    def _object(self, text: str, finish_reason: str | None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}]}

    @staticmethod
    def _usage(done: ReplyDone) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}

    async def sse(self) -> AsyncIterator[bytes | Fact]:
        async for event in self.chat.reply_events():
            yield event  # a reply event, or the engine's facts for the turn
            if isinstance(event, ContentDelta):
                yield SENT
                yield sse.encode(self._object(event.text, None))
            elif isinstance(event, ReplyDone):
                usage = self._usage(event)
                yield counts_of(event, usage)  # as sent (its counts are the ReplyDone's)
                yield SENT
                yield sse.encode(self._object("", event.finish_reason))
                if self.req.include_usage:
                    yield SENT
                    yield sse.encode({**self._object("", None), "choices": [], "usage": usage})
        yield sse.DONE

    async def whole(self) -> WholeReply:
        parts: list[str] = []
        facts: list[Fact] = []
        async for event in self.chat.reply_events():
            facts.append(event)
            if isinstance(event, ContentDelta):
                parts.append(event.text)
            elif isinstance(event, ReplyDone):
                body = {**self._object("".join(parts), event.finish_reason), "usage": self._usage(event)}
                facts.append(counts_of(event, body["usage"]))
                return WholeReply(json.dumps(body, ensure_ascii=False).encode(), "application/json", facts)
        raise RuntimeError("engine stream ended without a result")


def add_completions_route(app: FastAPI, backend: Backend, recorder: TurnSink) -> None:
    """`POST /v1/completions`, ending like chat completions (`proxy.relay.respond`)."""

    async def open_reply(req: ChatRequest, headers: dict[str, str], learnt: list[Fact]):
        if backend.embedded:
            return EngineCompletion(await backend.open_prompt(req, wire.prompt_of(req.body), learnt), req)
        # Framed as chat completions are: the turn committed before `data: [DONE]`, a late error as an error chunk.
        return await open_upstream(backend, req, headers, learnt, path=COMPLETIONS_PATH)

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request):
        return await serve_turn(request, endpoint=COMPLETIONS_PATH, backend=backend, recorder=recorder,
                                parse=parse_completion_request, open_reply=open_reply, framing=FRAMING,
                                error_body=to_openai_error)

"""Serve chat completions from the embedded engine, in OpenAI's wire format.

The engine thread emits events for a `Sequence`; this module hops them onto
the asyncio loop and turns them into chat.completion(.chunk) objects.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from engine.engine import Engine
from engine.sequence import Failed, Finished, Sequence, TextDelta
from prefixtrace.errors import EngineError, InvalidRequest, ModelNotFound, PrefixtraceError, to_openai_error
from prefixtrace.wire.events import ContentDelta, ReplyDone
from prefixtrace.wire import sse
from proxy.chat_request import ChatRequest
from prefixtrace.wire.turn_builder import TurnBuilder

DEFAULT_ALIAS = "default"


class EngineBackend:
    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def label(self) -> str:
        return f"embedded:{self.engine.name}"

    def model_ids(self) -> list[str]:
        return [self.engine.name, DEFAULT_ALIAS]

    async def ready(self) -> bool:
        return self.engine.ready

    async def capacity(self) -> dict:
        return self.engine.capacity()

    @property
    def max_context_tokens(self) -> int | None:
        return self.engine.memory.max_context_tokens if self.engine.ready else None

    async def models(self) -> dict:
        created = int(time.time())
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": created, "owned_by": "prefixtrace"} for m in self.model_ids()],
        }

    async def open(self, req: ChatRequest, builder: TurnBuilder, headers: dict[str, str]) -> "EngineChat":
        if req.model not in (None, "", *self.model_ids()):
            raise ModelNotFound(f"model {req.model!r} is not served here; available: {self.model_ids()}", param="model")
        n = req.body.get("n")
        if n is not None and n != 1:
            raise InvalidRequest(f"'n' must be 1 here (the embedded engine returns one choice), got {n!r}", param="n")
        try:
            rendered = await asyncio.to_thread(
                self.engine.render, req.messages, tools=req.tools, chat_template_kwargs=req.chat_template_kwargs
            )
        except (TypeError, ValueError) as exc:  # the tokenizer refuses text it cannot encode (lone surrogates)
            if _has_lone_surrogate(req.messages) or _has_lone_surrogate(req.tools):
                raise InvalidRequest("the messages contain invalid Unicode (a lone UTF-16 surrogate)",
                                     param="messages") from exc
            raise InvalidRequest(f"the messages could not be rendered: {type(exc).__name__}: {exc}") from exc
        self.engine.check_fits(len(rendered.token_ids), req.sampling.max_tokens)
        builder.turn.render = {"prompt_chars": len(rendered.text), "prompt_tokens": len(rendered.token_ids)}
        if rendered.policy is not None:  # render policies applied (docs/RENDER_POLICIES.md)
            builder.turn.render["policy"] = rendered.policy
        chat = EngineChat(req, builder, self.engine.name)
        seq = Sequence(rendered.token_ids, req.sampling, chat.emit_threadsafe(asyncio.get_running_loop()))
        chat.seq = seq
        self.engine.submit(seq)
        await chat.first_event()
        return chat


class EngineChat:
    """One request's stream of engine events, rendered as OpenAI objects."""

    status = 200

    def __init__(self, req: ChatRequest, builder: TurnBuilder, model: str):
        self.req = req
        self.builder = builder
        self.model = req.model or model
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.seq: Sequence | None = None
        self._events: asyncio.Queue = asyncio.Queue()
        self._first = None

    def emit_threadsafe(self, loop: asyncio.AbstractEventLoop):
        return lambda event: loop.call_soon_threadsafe(self._events.put_nowait, event)

    async def first_event(self) -> None:
        """Wait for the first event so that a failure before any output keeps its HTTP status."""
        self._first = await self._events.get()
        if isinstance(self._first, Failed):
            raise self._first.error

    async def events(self):
        event = self._first
        while True:
            yield event
            if isinstance(event, (Finished, Failed)):
                return
            event = await self._events.get()

    async def replies(self):
        """The engine's events as reply events (prefixtrace/wire/events.py), for the protocol
        writers; a failure is raised (in the error tree)."""
        async for event in self.events():
            if isinstance(event, TextDelta):
                if event.text:
                    yield ContentDelta(event.text)
            elif isinstance(event, Finished):
                yield ReplyDone(event.finish_reason, event.prompt_tokens, event.completion_tokens, event.cached_tokens)
            elif isinstance(event, Failed):
                raise event.error if isinstance(event.error, PrefixtraceError) else EngineError(str(event.error))

    @property
    def streams_events(self) -> bool:
        return self.req.stream

    def cancel(self) -> None:
        if self.seq is not None:
            self.seq.cancel()

    # --- streamed ---------------------------------------------------------------

    async def sse(self) -> AsyncIterator[bytes]:
        yield self._chunk({"role": "assistant", "content": ""})
        async for event in self.events():
            if isinstance(event, TextDelta):
                yield self._chunk({"content": event.text})
            elif isinstance(event, Finished):
                usage = _usage(event)
                self.builder.on_usage(usage)
                yield self._chunk({}, finish_reason=event.finish_reason)
                if self.req.include_usage:
                    yield self._emit({**self._envelope(), "choices": [], "usage": usage})
            elif isinstance(event, Failed):
                err = event.error
                body = to_openai_error(err) if isinstance(err, PrefixtraceError) else {"error": {"message": str(err)}}
                self.builder.turn.error = body["error"]["message"]
                yield sse.encode(body)
        yield sse.DONE

    def _chunk(self, delta: dict, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._emit({**self._envelope(), "choices": [choice]})

    def _emit(self, chunk: dict) -> bytes:
        self.builder.on_chunk(chunk)
        return sse.encode(chunk)

    def _envelope(self) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}

    # --- whole ------------------------------------------------------------------

    async def whole(self) -> tuple[bytes, str]:
        return json.dumps(await self.json()).encode(), "application/json"

    async def json(self) -> dict:
        parts: list[str] = []
        async for event in self.events():
            if isinstance(event, TextDelta):
                parts.append(event.text)
            elif isinstance(event, Failed):
                raise event.error
            elif isinstance(event, Finished):
                body = {
                    "id": self.id,
                    "object": "chat.completion",
                    "created": self.created,
                    "model": self.model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "".join(parts)},
                            "logprobs": None,
                            "finish_reason": event.finish_reason,
                        }
                    ],
                    "usage": _usage(event),
                }
                self.builder.on_response(body)
                if event.completion_tokens:
                    self.builder.turn.ttft_s = event.prefill_s
                return body
        raise RuntimeError("engine stream ended without a result")


def _has_lone_surrogate(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _usage(event: Finished) -> dict:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens},
    }

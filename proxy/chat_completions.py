"""OpenAI's chat completions (`POST /v1/chat/completions`): the backends' own protocol.

Both backends speak it natively (`Backend.open`, proxy/backend.py): the embedded engine writes its
reply events as chat.completion(.chunk) objects (`EngineChat`, proxy/engine_backend.py) and an
upstream's chunks pass through, read into the turn on the way (`UpstreamChat`,
proxy/upstream_backend.py). So this adapter is short: the route, the request's parse
(`parse_chat_request`, proxy/chat_request.py, which the other adapters translate into) and the
stream's framing: the turn committed before `data: [DONE]` goes out, a failure after the headers
sent as an OpenAI error chunk and then `[DONE]`.

Recorded with endpoint "/v1/chat/completions".
"""

from __future__ import annotations

import functools

from fastapi import FastAPI, Request

from prefixtrace.errors import PrefixtraceError, to_openai_error
from prefixtrace.wire import sse
from proxy.backend import Backend
from proxy.chat_request import parse_chat_request
from proxy.relay import TurnSink, serve_turn, stream_and_record

CHAT_PATH = "/v1/chat/completions"


def is_done(event: bytes) -> bool:
    """The end of an OpenAI stream (chat and legacy completions): the turn is committed before it."""
    return event == sse.DONE


def in_band_error(exc: PrefixtraceError) -> list[bytes]:
    """A failure after the headers went out, as OpenAI streams one: an error chunk, then [DONE]."""
    return [sse.encode(to_openai_error(exc)), sse.DONE]


# A streamed chat reply as sent, its turn recorded (proxy/relay.py `stream_and_record`).
stream = functools.partial(stream_and_record, is_end=is_done, in_band_error=in_band_error)


def add_chat_route(app: FastAPI, backend: Backend, recorder: TurnSink) -> None:
    """`POST /v1/chat/completions`: parsed here, opened by the backend itself, ended by `proxy.relay.respond`."""

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request):
        return await serve_turn(request, endpoint=CHAT_PATH, backend=backend, recorder=recorder,
                                parse=parse_chat_request, open_reply=backend.open, stream=stream,
                                error_body=to_openai_error)

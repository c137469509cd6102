"""OpenAI's remote compaction (`POST /v1/responses/compact`), passed through to the upstream.

Codex calls it instead of a summarisation turn when its provider is OpenAI: the conversation goes
in, its replacement comes back whole (`{"output": [kept items…, {"type": "compaction",
"encrypted_content": …}]}`), and Codex writes that replacement to its rollout. A proxy in front
of OpenAI must forward it, or the user's compaction fails. Recorded as a turn of its own endpoint
with the server's usage; the analyzer leaves it out of the call chain (it is no call of the loop:
its effect is the next call's compacted history) and counts it.

The embedded engine keeps no server-side compaction: a 404 in OpenAI's shape that says so (a
client then compacts locally, as Codex does with any provider not named OpenAI).
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from prefixtrace.common.errors import UnknownEndpoint, to_openai_error
from prefixtrace.wire import responses as wire
from prefixtrace.wire.responses import COMPACT_PATH
from prefixtrace.wire.events import Usage
from prefixtrace.wire.responses_stream import ResponsesReader
from proxy.backend import Backend, WholeReply
from proxy.chat_request import ChatRequest, passthrough_request
from proxy.relay import TurnSink, serve_turn
from proxy.responses import FRAMING  # never used: the reply is unary, but serve_turn takes one
from proxy.upstream_backend import Relayed, served_by
from proxy.upstream_query import with_query
from recorder.turn_facts import ErrorText, Fact, Served


class CompactionNotServed(UnknownEndpoint):
    """Remote compaction asked of the embedded engine, which has none."""


class UpstreamCompaction(Relayed):
    """The upstream's compaction, passed through whole; its usage kept as the turn's counts."""

    @property
    def streams_events(self) -> bool:
        return False  # a unary reply, whatever the request's `stream`

    async def whole(self) -> WholeReply:
        data, body = await self.read()
        facts: list[Fact] = []
        if body is not None and self.status < 400:
            # the counts only: the output is the client's new history, not a reply of the model's
            done = ResponsesReader().done({"usage": body.get("usage") or {}})
            usage = body.get("usage") if isinstance(body.get("usage"), dict) else None
            facts.append(Usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens, as_sent=usage))
        elif self.status >= 400:
            facts.append(ErrorText(self.error_text(data, body)))
        return WholeReply(data, self.content_type, facts)


def add_compact_route(app: FastAPI, backend: Backend, recorder: TurnSink) -> None:
    """`POST /v1/responses/compact`: to the upstream as sent; refused on the embedded engine."""

    def parse(body: dict, headers: dict[str, str]) -> ChatRequest:
        if backend.embedded:
            raise CompactionNotServed("the embedded engine does not compact conversations server-side: "
                                      f"POST {COMPACT_PATH} needs an upstream that does (OpenAI's); compact "
                                      "in the client instead")
        wire.input_items(body)
        req = passthrough_request(body, wire.session_id(body, headers))
        req.stream = False
        return req

    async def open_reply(req: ChatRequest, headers: dict[str, str], learnt: list[Fact]):
        response, url = await backend.post(with_query(COMPACT_PATH, req.query), req.body, headers,
                                           session_id=req.session_id, raw=req.raw)
        learnt.append(Served(served_by(response, url)))
        return UpstreamCompaction(response, url)

    @app.post(COMPACT_PATH)
    async def compact(request: Request):
        return await serve_turn(request, endpoint=COMPACT_PATH, backend=backend, recorder=recorder, parse=parse,
                                open_reply=open_reply, framing=FRAMING, error_body=to_openai_error)

"""A scripted model on loopback: answers Anthropic Messages, OpenAI Responses and OpenAI's
`/v1/responses/compact` with prepared replies, so a real harness behind `prefixtrace serve
--upstream` writes its real session file with what a tiny model cannot write (a compaction summary,
parallel tool calls, an opaque compaction item).

Only the model is scripted: `reply(endpoint, body)` (the caller's function) picks each answer from
the request; this module writes it in the protocol's own shape, streamed when asked. Usage is a
prefix cache's honest count over the request's JSON text (4 characters a token): the tokens of the
longest prefix it shares with any earlier request on that endpoint are "cached", the rest are new.
Every request is kept (`ScriptedUpstream.received`) so a test can check what reached the model.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from dataclasses import dataclass, field
from typing import Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

CHARS_PER_TOKEN = 4


@dataclass
class Reply:
    """What the model answers. Messages: `blocks` are Anthropic content blocks (text, tool_use).
    Responses: `items` are output items (message, function_call). Compact: `items` is the output."""
    blocks: list[dict] = field(default_factory=list)
    items: list[dict] = field(default_factory=list)
    pause_s: float = 0.0  # between streamed blocks: a client that acts on a block before the reply ends shows it


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def tool_use(name: str, **arguments) -> dict:
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": name, "input": arguments}


def message_item(text: str) -> dict:
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def function_call(name: str, **arguments) -> dict:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": "call_" + uuid.uuid4().hex[:24],
            "name": name, "arguments": json.dumps(arguments), "status": "completed"}


def compaction_item() -> dict:
    """OpenAI's compaction item: its content is opaque to the client (encrypted on OpenAI)."""
    return {"type": "compaction", "id": "cmp_" + uuid.uuid4().hex[:24],
            "encrypted_content": "scripted-opaque-" + os.urandom(24).hex()}


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class ScriptedUpstream:
    """The ASGI app. `reply(endpoint, body) -> Reply` is the script."""

    def __init__(self, reply: Callable[[str, dict], Reply], model: str = "scripted"):
        self.reply = reply
        self.model = model
        self.received: list[tuple[str, dict]] = []
        self._seen: dict[str, list[str]] = {}  # every prompt text so far, per endpoint: the cache never evicts
        self.app = Starlette(routes=[
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/compact", self.compact, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/", lambda r: JSONResponse({"ok": True}), methods=["GET", "HEAD"]),
        ])

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)

    # --- usage: a prefix cache over the request's text -------------------------------------------

    def _usage(self, endpoint: str, body: dict) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of this request."""
        # in the order the provider caches them: tools and system first, then the conversation
        text = json.dumps([body.get(k) for k in ("tools", "system", "instructions", "messages", "input")])
        seen = self._seen.setdefault(endpoint, [])
        common = max((len(os.path.commonprefix([text, before])) for before in seen), default=0)
        seen.append(text)
        return len(text) // CHARS_PER_TOKEN, common // CHARS_PER_TOKEN

    async def _body(self, request: Request, endpoint: str) -> dict:
        body = json.loads(await request.body())
        self.received.append((endpoint, body))
        return body

    # --- Anthropic Messages ----------------------------------------------------------------------

    async def messages(self, request: Request):
        body = await self._body(request, "/v1/messages")
        reply = self.reply("/v1/messages", body)
        prompt, cached = self._usage("/v1/messages", body)
        usage = {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": cached, "output_tokens": 0}
        out_tokens = max(1, len(json.dumps(reply.blocks)) // CHARS_PER_TOKEN)
        stop = "tool_use" if any(b["type"] == "tool_use" for b in reply.blocks) else "end_turn"
        message = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant",
                   "model": body.get("model", self.model), "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": usage}
        if not body.get("stream"):
            return JSONResponse({**message, "content": reply.blocks, "stop_reason": stop,
                                 "usage": {**usage, "output_tokens": out_tokens}})

        async def events():
            yield _sse("message_start", {"type": "message_start", "message": message})
            for i, block in enumerate(reply.blocks):
                if i and reply.pause_s:
                    await asyncio.sleep(reply.pause_s)
                if block["type"] == "text":
                    yield _sse("content_block_start", {"type": "content_block_start", "index": i,
                                                       "content_block": {"type": "text", "text": ""}})
                    delta = {"type": "text_delta", "text": block["text"]}
                else:
                    yield _sse("content_block_start", {"type": "content_block_start", "index": i,
                                                       "content_block": {**block, "input": {}}})
                    delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta})
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": i})
            yield _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                         "usage": {"output_tokens": out_tokens}})
            yield _sse("message_stop", {"type": "message_stop"})
        return StreamingResponse(events(), media_type="text/event-stream")

    async def count_tokens(self, request: Request):
        body = await self._body(request, "/v1/messages/count_tokens")
        return JSONResponse({"input_tokens": len(json.dumps(body)) // CHARS_PER_TOKEN})

    # --- OpenAI Responses ------------------------------------------------------------------------

    def _response(self, body: dict, items: list[dict], status: str, endpoint: str) -> dict:
        prompt, cached = self._usage(endpoint, body)
        out_tokens = max(1, len(json.dumps(items)) // CHARS_PER_TOKEN)
        return {"id": "resp_" + uuid.uuid4().hex[:24], "object": "response", "status": status,
                "model": body.get("model", self.model), "output": items,
                "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                          "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": prompt + out_tokens}}

    async def responses(self, request: Request):
        body = await self._body(request, "/v1/responses")
        items = self.reply("/v1/responses", body).items
        done = self._response(body, items, "completed", "/v1/responses")
        if not body.get("stream"):
            return JSONResponse(done)

        def events():
            start = {**done, "status": "in_progress", "output": [], "usage": None}
            yield _sse("response.created", {"type": "response.created", "response": start})
            for i, item in enumerate(items):
                yield _sse("response.output_item.added", {"type": "response.output_item.added", "output_index": i,
                                                          "item": item})
                if item["type"] == "message":
                    text = item["content"][0]["text"]
                    yield _sse("response.output_text.delta", {"type": "response.output_text.delta", "item_id": item["id"],
                                                              "output_index": i, "content_index": 0, "delta": text})
                yield _sse("response.output_item.done", {"type": "response.output_item.done", "output_index": i,
                                                         "item": item})
            yield _sse("response.completed", {"type": "response.completed", "response": done})
        return StreamingResponse(events(), media_type="text/event-stream")

    async def compact(self, request: Request):
        """OpenAI's `/v1/responses/compact`: a unary reply `{"output": [items]}` that replaces the history."""
        body = await self._body(request, "/v1/responses/compact")
        items = self.reply("/v1/responses/compact", body).items
        return JSONResponse({**self._response(body, items, "completed", "/v1/responses/compact"),
                             "object": "response.compaction"})

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})


def serve_forever(reply: Callable[[str, dict], Reply], port: int, log: str | None = None) -> None:
    """Run the scripted model in the foreground until stopped (SIGINT or SIGTERM); `log`: a JSONL file
    of every request it received, written when it stops."""
    import uvicorn

    upstream = ScriptedUpstream(reply)
    try:
        uvicorn.run(upstream, host="127.0.0.1", port=port, log_level="warning")
    finally:
        if log:
            with open(log, "w") as out:
                out.writelines(json.dumps({"endpoint": e, "body": b}) + "\n" for e, b in upstream.received)

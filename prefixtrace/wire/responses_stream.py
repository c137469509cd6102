"""Responses API replies: reply events → Response objects and stream events, and back.

`ResponsesWriter` is fed reply events (prefixtrace/wire/events.py) and returns the stream events
each one means, in the standard order: `response.created`, `response.in_progress`, then per output
item `response.output_item.added`, its parts and deltas (`response.content_part.added`,
`response.output_text.delta` … `.done`, `response.reasoning_text.delta` … `.done`,
`response.function_call_arguments.delta` … `.done`), `response.output_item.done`, and last
`response.completed` (its Response's status "incomplete" when max_output_tokens cut it;
`response.failed` on an error), each with its `sequence_number`. `response()` is the Response object itself (the
non-streamed body and the one inside created/completed).

`ResponsesReader` does the reverse for an upstream's stream or body, so the turn recorded from a
passed-through reply is built from the same events as the engine's.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterator

from prefixtrace.wire.events import (ContentDelta, ReasoningDelta, ReplyDone, ReplyEvent, ToolCallArgsDelta,
                         ToolCallStart)

TERMINAL = ("response.completed", "response.incomplete", "response.failed")
# Request fields echoed in the Response object, with the API's defaults.
_ECHO = {"instructions": None, "max_output_tokens": None, "metadata": {}, "parallel_tool_calls": True,
         "previous_response_id": None, "reasoning": None, "store": True, "temperature": 1.0,
         "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [], "top_p": 1.0,
         "truncation": "disabled", "user": None, "prompt_cache_key": None}


def usage_object(done: ReplyDone) -> dict:
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens or 0},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


class ResponsesWriter:
    """One reply's Response object and stream events, built from its reply events."""

    def __init__(self, body: dict, model: str, response_id: str | None = None):
        self.id = response_id or "resp_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.model = model
        self.echo = {k: body.get(k, default) if body.get(k) is not None else default for k, default in _ECHO.items()}
        self.output: list[dict] = []
        self.status = "in_progress"
        self.usage: dict | None = None
        self.error: dict | None = None
        self.incomplete: dict | None = None
        self.completed_at: int | None = None
        self._seq = 0
        self._open: dict | None = None  # the output item being written
        self._calls: dict[int, dict] = {}  # tool-call index → its function_call item
        self.one_call = body.get("parallel_tool_calls") is False

    # --- the Response object -----------------------------------------------------

    def response(self) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "completed_at": self.completed_at,
                "error": self.error, "incomplete_details": self.incomplete, "model": self.model,
                "output": [dict(item) for item in self.output], "usage": self.usage, **self.echo}

    def output_text(self) -> str:
        return "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])

    # --- stream events -------------------------------------------------------------

    def _event(self, kind: str, **data: Any) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return event

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def accepts(self, event: ReplyEvent) -> bool:
        """Whether `event` belongs in this reply: with `parallel_tool_calls: false` a call after the
        first does not (the model may write more; the caller drops them before recording too)."""
        return not (self.one_call and isinstance(event, (ToolCallStart, ToolCallArgsDelta)) and event.index > 0)

    def feed(self, event: ReplyEvent) -> list[dict]:
        if isinstance(event, ContentDelta):
            return self._text("message", "output_text", event.text) if event.text else []
        if isinstance(event, ReasoningDelta):
            return self._text("reasoning", "reasoning_text", event.text) if event.text else []
        if isinstance(event, ToolCallStart):
            out = self._close()
            item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": "in_progress",
                    "arguments": "", "call_id": event.call_id, "name": event.name}
            self._calls[event.index] = item
            return out + self._add(item)
        if isinstance(event, ToolCallArgsDelta):
            item = self._calls.get(event.index)
            if item is None or not event.text:
                return []
            item["arguments"] += event.text
            return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=self.output.index(item), delta=event.text)]
        if isinstance(event, ReplyDone):
            # The item max_output_tokens cut short says so (a call's arguments may not parse), as OpenAI's do.
            return self._close("incomplete" if event.finish_reason == "length" else "completed") + self._finish(event)
        return []

    def fail(self, code: str, message: str) -> list[dict]:
        out = self._close()
        self.status, self.error = "failed", {"code": code, "message": message}
        return out + [self._event("response.failed", response=self.response())]

    def _add(self, item: dict) -> list[dict]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]

    def _text(self, kind: str, part_type: str, text: str) -> list[dict]:
        out: list[dict] = []
        item = self._open
        if item is None or item["type"] != kind:
            out += self._close()
            if kind == "message":
                item = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []}
            else:
                item = {"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [], "content": []}
            out += self._add(item)
            part = {"type": part_type, "text": "", **({"annotations": [], "logprobs": []} if kind == "message" else {})}
            item["content"] = [part]
            out.append(self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self.output) - 1, content_index=0, part=dict(part)))
        part = item["content"][0]
        part["text"] += text
        delta = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(f"response.{part_type}.delta", item_id=item["id"], output_index=len(self.output) - 1,
                               content_index=0, delta=text, **delta))
        return out

    def _close(self, status: str = "completed") -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        out: list[dict] = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out.append(self._event(f"response.{part['type']}.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], **extra))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=dict(part)))
        elif item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        if "status" in item:
            item["status"] = status
        out.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return out

    def _finish(self, done: ReplyDone) -> list[dict]:
        self.usage = usage_object(done)
        self.completed_at = int(time.time())
        # A reply cut by max_output_tokens still ends in response.completed, with the Response's
        # status "incomplete" (as vLLM does): the official clients' stream helpers and Codex treat
        # a stream without response.completed as failed.
        if done.finish_reason == "length":
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        return [self._event("response.completed", response=self.response())]


def encode(event: dict) -> bytes:
    """One stream event as SSE, with its `event:` line as OpenAI sends it."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponsesReader:
    """An upstream's Responses stream events (or whole body) → reply events."""

    def __init__(self):
        self._index: dict[str, int] = {}  # function_call item id → tool-call index
        self._args_seen: set[int] = set()

    def feed(self, event: dict) -> Iterator[ReplyEvent]:
        kind = event.get("type")
        if kind == "response.output_text.delta" and isinstance(event.get("delta"), str):
            yield ContentDelta(event["delta"])
        elif kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta") and \
                isinstance(event.get("delta"), str):
            yield ReasoningDelta(event["delta"])
        elif kind == "response.output_item.added":
            item = event.get("item") or {}
            if item.get("type") == "function_call":
                yield from self._call_start(item)
        elif kind == "response.function_call_arguments.delta" and event.get("item_id") in self._index:
            index = self._index[event["item_id"]]
            self._args_seen.add(index)
            yield ToolCallArgsDelta(index, str(event.get("delta") or ""))
        elif kind == "response.output_item.done":
            item = event.get("item") or {}
            if item.get("type") == "function_call":
                if item.get("id") not in self._index:
                    yield from self._call_start(item)
                index = self._index[item.get("id")]
                if index not in self._args_seen and item.get("arguments"):  # sent whole, not in deltas
                    self._args_seen.add(index)
                    yield ToolCallArgsDelta(index, str(item["arguments"]))
        elif kind in TERMINAL:
            yield self.done(event.get("response") or {})

    def _call_start(self, item: dict) -> Iterator[ReplyEvent]:
        index = len(self._index)
        self._index[item.get("id") or f"item-{index}"] = index
        yield ToolCallStart(index, str(item.get("call_id") or item.get("id") or ""), str(item.get("name") or ""))

    def done(self, response: dict) -> ReplyDone:
        usage = response.get("usage") or {}
        details = usage.get("input_tokens_details") if isinstance(usage.get("input_tokens_details"), dict) else {}
        cached = details.get("cached_tokens")
        status = response.get("status")
        calls = any(isinstance(i, dict) and i.get("type") == "function_call" for i in response.get("output") or [])
        reason = {"incomplete": "length", "failed": "error", "cancelled": "cancelled"}.get(
            status, "tool_calls" if calls else "stop")
        return ReplyDone(reason, _int(usage.get("input_tokens")), _int(usage.get("output_tokens")),
                         cached if isinstance(cached, int) else None, usage=response.get("usage"))

    def whole(self, response: dict) -> Iterator[ReplyEvent]:
        """The reply events of a non-streamed Response object."""
        for item in response.get("output") or []:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "message":
                for part in item.get("content") or []:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        yield ContentDelta(part["text"])
            elif item.get("type") == "reasoning":
                for part in (item.get("content") or []) + (item.get("summary") or []):
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        yield ReasoningDelta(part["text"])
            elif item.get("type") == "function_call":
                yield from self._call_start(item)
                yield ToolCallArgsDelta(len(self._index) - 1, str(item.get("arguments") or ""))
        yield self.done(response)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None  # unknown is not 0

"""Fill a recorder `Turn` from what the client is sent, whichever backend made it.

The turn is built from what goes out: reply events (`on_event`, prefixtrace/wire/events.py),
which every protocol's writer consumes and every upstream reader produces, or chat-completions
chunks and bodies as they are (`on_chunk`, `on_response`). What is recorded is what the client saw.
"""

from __future__ import annotations

import time
from typing import Any

from prefixtrace.wire.events import (ContentDelta, ReasoningDelta, ReplyDone, ReplyEvent, ToolCallArgsDelta,
                                     ToolCallStart)
from recorder.turn import Turn


class TurnBuilder:
    def __init__(self, turn: Turn):
        self.turn = turn
        self._t0 = time.perf_counter()
        self._tool_calls: dict[int, dict] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        turn = self.turn
        turn.chunk_times.append(round(self.elapsed(), 6))
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            content = delta.get("content") if "text" not in choice else choice["text"]  # legacy completions
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if (content or reasoning or delta.get("tool_calls")) and turn.ttft_s is None:
                turn.ttft_s = self.elapsed()
            turn.response_text += content or ""
            turn.reasoning_text += reasoning or ""
            for call in delta.get("tool_calls") or []:
                self._merge_tool_call(call)
            if choice.get("finish_reason"):
                turn.finish_reason = choice["finish_reason"]
        if chunk.get("usage"):
            self.on_usage(chunk["usage"])

    def on_event(self, event: ReplyEvent) -> None:
        """One reply event, as the client is sent it (in whatever protocol)."""
        turn = self.turn
        if isinstance(event, (ContentDelta, ReasoningDelta, ToolCallStart)) and turn.ttft_s is None:
            turn.ttft_s = self.elapsed()
        if isinstance(event, ContentDelta):
            turn.response_text += event.text
        elif isinstance(event, ReasoningDelta):
            turn.reasoning_text += event.text
        elif isinstance(event, ToolCallStart):
            self._merge_tool_call({"index": event.index, "id": event.call_id, "function": {"name": event.name}})
        elif isinstance(event, ToolCallArgsDelta):
            self._merge_tool_call({"index": event.index, "function": {"arguments": event.text}})
        elif isinstance(event, ReplyDone):
            turn.finish_reason = event.finish_reason
            turn.prompt_tokens, turn.completion_tokens = event.prompt_tokens, event.completion_tokens
            turn.cached_tokens = event.cached_tokens

    def on_whole(self, events) -> None:
        """The reply events of a whole (non-streamed) body: no first token was seen apart from
        the rest, so TTFT stays what the backend measured (None from an upstream)."""
        ttft = self.turn.ttft_s
        for event in events:
            self.on_event(event)
        self.turn.ttft_s = ttft

    def on_sent(self) -> None:
        """One SSE event went out (its time is kept for the recorded chunk timeline)."""
        self.turn.chunk_times.append(round(self.elapsed(), 6))

    def on_response(self, body: dict[str, Any]) -> None:
        """A whole (non-streamed) chat.completion body."""
        choices = body.get("choices") or []
        if choices:
            message = choices[0].get("message") or {}
            self.turn.response_text = message.get("content") or choices[0].get("text") or ""
            self.turn.reasoning_text = message.get("reasoning_content") or message.get("reasoning") or ""
            self.turn.tool_calls = message.get("tool_calls") or None
            self.turn.finish_reason = choices[0].get("finish_reason")
        if body.get("usage"):
            self.on_usage(body["usage"])

    def on_usage(self, usage: dict[str, Any]) -> None:
        turn = self.turn
        turn.usage = usage
        turn.prompt_tokens = usage.get("prompt_tokens")
        turn.completion_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        # Unknown stays None: an upstream that does not report cached tokens
        # must not look like one that reported a cache miss.
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        turn.cached_tokens = cached if isinstance(cached, int) else None

    def finish(self, status: int, error: str | None = None) -> Turn:
        self.turn.status = status
        if error and not self.turn.error:
            self.turn.error = error
        if self._tool_calls:
            self.turn.tool_calls = [self._tool_calls[i] for i in sorted(self._tool_calls)]
        self.turn.total_s = self.elapsed()
        return self.turn

    def _merge_tool_call(self, call: dict) -> None:
        slot = self._tool_calls.setdefault(
            call.get("index", len(self._tool_calls)),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if call.get("id"):
            slot["id"] = call["id"]
        fn = call.get("function") or {}
        slot["function"]["name"] += fn.get("name") or ""
        slot["function"]["arguments"] += fn.get("arguments") or ""

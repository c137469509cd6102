"""Fill a recorder `Turn` from what the client is sent, whichever backend made it: with the relay, the
only writer of a turn's fields (tests/test_turn_fields_owned.py).

The request arrives through the relay's calls (`on_request`, `on_session`); what the backend that
answers tells of itself through `on_served`, `on_render` and `on_error`.

The turn is built from what goes out: reply events (`on_event`, prefixtrace/wire/events.py),
which every protocol's writer consumes and every upstream reader produces, or chat-completions
chunks and bodies as they are (`on_chunk`, `on_response`). What is recorded is what the client saw.

Text arrives in pieces (a token or a few per event) and is kept as a list of them, joined once
(`text_so_far`, `finish`): `turn.response_text += piece` copies the whole text per piece, quadratic
on the event loop (issue 25: a 20 MB streamed reply took minutes). A chunk or body of the wrong
shape (`"choices": "x"`) raises `ValueError` naming what is wrong: the caller decides whether that
is the upstream's fault (proxy/upstream_backend.py); nothing of a foreign type reaches the turn.
"""

from __future__ import annotations

import time
from typing import Any

from prefixtrace.wire.events import (ContentDelta, ReasoningDelta, ReplyDone, ReplyEvent, ToolCallArgsDelta, Usage,
                         ToolCallStart)
from recorder.renderers import RendererInfo
from recorder.turn import Turn


class TurnBuilder:
    """`timed=False`: a reply read from a recording (a HAR), whose times are the recording's and already
    on the turn: the builder's own clock then stamps nothing (no TTFT, chunk times or total)."""

    def __init__(self, turn: Turn, *, timed: bool = True):
        self.turn = turn
        self.timed = timed
        self._t0 = time.perf_counter()
        self._tool_calls: dict[int, dict] = {}
        self._text: list[str] = []  # pieces not yet joined into turn.response_text
        self._reasoning: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    # What the relay learns of the request (proxy/relay.py).

    def on_request(self, body: Any, raw: str | None = None, *, headers: dict[str, str] | None = None,
                   fixes: list[dict] | None = None) -> None:
        """The request as it goes on: its body (parsed, or the text or marker stored in its place), the
        body's exact text, the headers it is sent with and the `serve --fix` entries applied to it."""
        turn = self.turn
        turn.request_body, turn.request_raw = body, raw
        if headers is not None:
            turn.request_headers = headers
        if fixes is not None:
            turn.fixes = fixes

    def on_session(self, session_id: str | None, *, stream: bool | None = None) -> None:
        """The session the request is filed under, and whether its reply streams (None: not known
        here, what was told stands)."""
        self.turn.session_id = session_id
        if stream is not None:
            self.turn.stream = stream

    # What the backend that answers tells of itself and of the prompt it ran.

    def on_served(self, by: str) -> None:
        """Who answered: an engine, an upstream member, a router's worker."""
        self.turn.served_by = by

    def on_renderer(self, renderer: RendererInfo | None) -> None:
        """The renderer that built and counted the prompt, as the backend that answered knows it
        (None: not known); the recorder stores its row from the turn."""
        self.turn.renderer = renderer
        self.turn.renderer_id = renderer.id if renderer is not None else None

    def on_render(self, **facts: Any) -> None:
        """Engine-side facts of the prompt and the reply (`prompt_tokens`, `policy`, `reply_token_ids`, ...),
        added to `turn.render`."""
        if self.turn.render is None:
            self.turn.render = {}
        self.turn.render.update(facts)

    def on_stop(self, finish_reason: str | None) -> None:
        """How the reply ended, where its protocol tells it apart from the rest (Messages' stop_reason,
        in OpenAI's terms): None keeps what was told before."""
        if finish_reason is not None:
            self.turn.finish_reason = finish_reason

    def on_error(self, message: str) -> None:
        """The reply failed, as its backend told it (in band, or an error body): the turn's error."""
        self.turn.error = message

    def text_so_far(self) -> None:
        """Join the pieces received so far into `turn.response_text` / `reasoning_text` (linear:
        called once a reply is done, not per piece)."""
        turn = self.turn
        if self._text:
            turn.response_text = "".join([turn.response_text, *self._text])
            self._text.clear()
        if self._reasoning:
            turn.reasoning_text = "".join([turn.reasoning_text, *self._reasoning])
            self._reasoning.clear()

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        turn = self.turn
        if self.timed:
            turn.chunk_times.append(round(time.perf_counter() - self._t0, 6))
        usage = chunk.get("usage")
        for choice in _listed(chunk.get("choices"), "choices"):
            if not isinstance(choice, dict):
                raise ValueError("a choice is not an object")
            if choice.get("index", 0) != 0:
                continue
            delta = _object(choice.get("delta"), "delta")
            content = _content(delta.get("content") if "text" not in choice else choice["text"])
            reasoning = _text(delta.get("reasoning_content") or delta.get("reasoning"), "reasoning")
            calls = _listed(delta.get("tool_calls"), "tool_calls")
            if (content or reasoning or calls) and turn.ttft_s is None and self.timed:
                turn.ttft_s = self.elapsed()
            if content:
                self._text.append(content)
            if reasoning:
                self._reasoning.append(reasoning)
            for call in calls:
                self._merge_tool_call(_object(call, "tool call"))
            if choice.get("finish_reason"):
                turn.finish_reason = _text(choice["finish_reason"], "finish_reason")
                self.text_so_far()  # the reply is whole
        if usage:
            self.on_usage(_object(usage, "usage"))

    def on_event(self, event: ReplyEvent) -> None:
        """One reply event, as the client is sent it (in whatever protocol)."""
        turn = self.turn
        if isinstance(event, (ContentDelta, ReasoningDelta, ToolCallStart)) and turn.ttft_s is None and self.timed:
            turn.ttft_s = self.elapsed()
        if isinstance(event, ContentDelta):
            self._text.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self._reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            self._merge_tool_call({"index": event.index, "id": event.call_id, "function": {"name": event.name}})
        elif isinstance(event, ToolCallArgsDelta):
            self._merge_tool_call({"index": event.index, "function": {"arguments": event.text}})
        elif isinstance(event, ReplyDone):
            self.text_so_far()  # the reply is whole: its writers may read the text now
            turn.finish_reason = event.finish_reason
            self.on_counts(Usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens,
                                 as_sent=event.usage))

    def on_whole(self, events, *, ttft_s: float | None = None) -> None:
        """The reply events of a whole (non-streamed) body: no first token was seen apart from
        the rest, so TTFT stays what the backend measured (`ttft_s`; None: the turn's stays, None
        from an upstream)."""
        ttft = self.turn.ttft_s if ttft_s is None else ttft_s
        for event in events:
            self.on_event(event)
        self.text_so_far()
        self.turn.ttft_s = ttft

    def on_sent(self) -> None:
        """One SSE event went out (its time is kept for the recorded chunk timeline)."""
        if self.timed:
            self.turn.chunk_times.append(round(self.elapsed(), 6))

    def on_response(self, body: dict[str, Any], *, ttft_s: float | None = None) -> None:
        """A whole (non-streamed) chat.completion body; `ttft_s`: the first token's time as the backend
        measured it (None: not known, the turn's stays)."""
        choices = _listed(body.get("choices"), "choices")
        usage = body.get("usage")
        if choices:
            choice = _object(choices[0], "choice")
            message = _object(choice.get("message"), "message")
            text = _content(message.get("content")) or _text(choice.get("text"), "text") or ""
            reasoning = _text(message.get("reasoning_content") or message.get("reasoning"), "reasoning") or ""
            calls = _listed(message.get("tool_calls"), "tool_calls")
            finish = _text(choice.get("finish_reason"), "finish_reason")
            if usage:
                usage = _object(usage, "usage")
            self._text.clear()
            self._reasoning.clear()
            self.turn.response_text, self.turn.reasoning_text = text, reasoning
            self.turn.tool_calls = calls or None
            self.turn.finish_reason = finish
        if usage:
            self.on_usage(_object(usage, "usage"))
        if ttft_s is not None:
            self.turn.ttft_s = ttft_s

    def on_usage(self, usage: dict[str, Any]) -> None:
        """An OpenAI usage object (a chat chunk's or a whole body's)."""
        details = usage.get("prompt_tokens_details") or {}
        # Unknown stays None: an upstream that does not report cached tokens
        # must not look like one that reported a cache miss.
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        self.on_counts(Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"),
                             cached if isinstance(cached, int) else None, as_sent=usage))

    def on_counts(self, usage: Usage) -> None:
        """The reply's token counts, whatever protocol told them: the only writer of `cached_tokens`."""
        turn = self.turn
        if usage.as_sent is not None:
            turn.usage = usage.as_sent
        if usage.prompt_tokens is not None:
            turn.prompt_tokens = usage.prompt_tokens
        if usage.completion_tokens is not None:
            turn.completion_tokens = usage.completion_tokens
        turn.cached_tokens = usage.cached_tokens

    def cancelled(self, error: str) -> Turn:
        """The turn of a reply stopped before its end (the client hung up, the server is stopping):
        499, "cancelled" unless the reply had already said how it ended."""
        if self.turn.finish_reason is None:
            self.turn.finish_reason = "cancelled"
        return self.finish(499, error)

    def finish(self, status: int, error: str | None = None) -> Turn:
        self.turn.status = status
        if error and not self.turn.error:
            self.turn.error = error
        self.text_so_far()
        if self._tool_calls:
            self.turn.tool_calls = [_joined_call(self._tool_calls[i]) for i in sorted(self._tool_calls)]
        if self.timed:
            self.turn.total_s = self.elapsed()
        return self.turn

    def _merge_tool_call(self, call: dict) -> None:
        # Arguments arrive in pieces like text: kept as a list, joined at `finish`.
        index = call.get("index", len(self._tool_calls))
        slot = self._tool_calls.get(index)
        if slot is None:
            slot = self._tool_calls[index] = {"id": None, "type": "function",
                                              "function": {"name": "", "arguments": []}}
        if call.get("id"):
            slot["id"] = call["id"]
        fn = _object(call.get("function"), "function")
        name = _text(fn.get("name"), "function name")
        if name:
            slot["function"]["name"] += name
        arguments = _text(fn.get("arguments"), "arguments")
        if arguments:
            slot["function"]["arguments"].append(arguments)


def _joined_call(slot: dict) -> dict:
    fn = slot["function"]
    return {**slot, "function": {**fn, "arguments": "".join(fn["arguments"])}}


def _listed(value: Any, what: str) -> list:
    """`value` when it is a list, [] when absent; a `ValueError` naming `what` otherwise."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{what!r} is a {type(value).__name__}, not a list")
    return value


def _object(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{what!r} is a {type(value).__name__}, not an object")
    return value


def _content(value: Any) -> str | None:
    """A message's content: a string, or a list of parts whose text is joined (some servers send
    `[{"type": "text", "text": ...}]`)."""
    if isinstance(value, list):
        return "".join(part["text"] for part in value if isinstance(part, dict) and isinstance(part.get("text"), str))
    return _text(value, "content")


def _text(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{what!r} is a {type(value).__name__}, not a string")

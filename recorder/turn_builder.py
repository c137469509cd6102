"""Fill a recorder `Turn` from what the client is sent, whichever backend made it: with the relay, the
only writer of a turn's fields (tests/test_turn_fields_owned.py), and fed by the relay alone
(tests/test_builder_fed_by_relay.py).

The request arrives through the relay's calls (`on_request`, `on_session`); everything a reply and
its backend tell arrives through one entry, `feed`, as the typed facts of recorder/turn_facts.py:
what the engine rendered, who served, reply events (prefixtrace/wire/events.py, which every
protocol's writer consumes and every upstream reader produces), chat-completions chunks and bodies
as sent, counts, the stop reason, an upstream's error. What is recorded is what the client saw.
A fact is checked where it is read (`ChatChunk.read`), so applying one never fails.

Text arrives in pieces (a token or a few per event) and is kept as a list of them, joined once
(`_text_so_far`, `finish`): `turn.response_text += piece` copies the whole text per piece, quadratic
on the event loop (issue 25: a 20 MB streamed reply took minutes).
"""

from __future__ import annotations

import time
from typing import Any

from prefixtrace.wire.events import (ContentDelta, ReasoningDelta, ReplyDone, ReplyEvent, ToolCallArgsDelta, Usage,
                         ToolCallStart)
from recorder.turn import Turn
from recorder.turn_facts import (ChatBody, ChatChunk, Constrained, ErrorText, Fact, MaxTokensClamped, RenderedBy,
                                 Rendered, ReplyTokens, Sent, Served, Stop, UpstreamFault, WholeEvents)


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

    def _elapsed(self) -> float:
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

    # What the reply tells: one entry, the relay's (proxy/relay.py), for every fact of recorder/turn_facts.py.

    def feed(self, fact: Fact) -> None:
        """One fact a reply told (recorder/turn_facts.py), applied to the turn."""
        _APPLY[type(fact)](self, fact)

    def _rendered(self, fact: Rendered) -> None:
        facts = {"prompt_chars": fact.prompt_chars, "prompt_tokens": fact.prompt_tokens}
        if fact.policy is not None:
            facts["policy"] = fact.policy
        self._render(facts)

    def _render(self, facts: dict[str, Any]) -> None:
        """Engine-side facts of the prompt and the reply, added to `turn.render`."""
        if self.turn.render is None:
            self.turn.render = {}
        self.turn.render.update(facts)

    def _reply_tokens(self, fact: ReplyTokens) -> None:
        # The reply's tokens follow the prompt in the engine's cache: the next turn's prefix reaches into
        # them, and the analyzer predicts how far (docs/ANALYZER.md). Only beside a rendered prompt.
        if self.turn.render is None:
            return
        self._render({"reply_token_ids": fact.token_ids})
        if fact.cache_evictions is not None:
            self._render({"cache_evictions": fact.cache_evictions})

    def _renderer(self, fact: RenderedBy) -> None:
        self.turn.renderer = fact.renderer
        self.turn.renderer_id = fact.renderer.id if fact.renderer is not None else None

    def _served(self, fact: Served) -> None:
        self.turn.served_by = fact.by

    def _stop(self, fact: Stop) -> None:
        if fact.finish_reason is not None:
            self.turn.finish_reason = fact.finish_reason

    def _error(self, fact: ErrorText) -> None:
        self.turn.error = fact.message

    def _fault(self, fact: UpstreamFault) -> None:
        if not self.turn.error:
            self.turn.error = fact.message

    def _text_so_far(self) -> None:
        """Join the pieces received so far into `turn.response_text` / `reasoning_text` (linear:
        called once a reply is done, not per piece)."""
        turn = self.turn
        if self._text:
            turn.response_text = "".join([turn.response_text, *self._text])
            self._text.clear()
        if self._reasoning:
            turn.reasoning_text = "".join([turn.reasoning_text, *self._reasoning])
            self._reasoning.clear()

    def _chunk(self, chunk: ChatChunk) -> None:
        turn = self.turn
        if self.timed:
            turn.chunk_times.append(round(time.perf_counter() - self._t0, 6))
        for choice in chunk.choices:
            if (choice.content or choice.reasoning or choice.calls) and turn.ttft_s is None and self.timed:
                turn.ttft_s = self._elapsed()
            if choice.content:
                self._text.append(choice.content)
            if choice.reasoning:
                self._reasoning.append(choice.reasoning)
            for call in choice.calls:
                self._merge_tool_call(call.index, call.call_id, call.name, call.arguments)
            if choice.finish_reason:
                turn.finish_reason = choice.finish_reason
                self._text_so_far()  # the reply is whole
        if chunk.usage is not None:
            self._counts(chunk.usage)

    def _event(self, event: ReplyEvent) -> None:
        """One reply event, as the client is sent it (in whatever protocol)."""
        turn = self.turn
        if isinstance(event, (ContentDelta, ReasoningDelta, ToolCallStart)) and turn.ttft_s is None and self.timed:
            turn.ttft_s = self._elapsed()
        if isinstance(event, ContentDelta):
            self._text.append(event.text)
        elif isinstance(event, ReasoningDelta):
            self._reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            self._merge_tool_call(event.index, event.call_id, event.name, None)
        elif isinstance(event, ToolCallArgsDelta):
            self._merge_tool_call(event.index, None, None, event.text)
        elif isinstance(event, ReplyDone):
            self._text_so_far()  # the reply is whole
            turn.finish_reason = event.finish_reason
            self._counts(Usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens,
                               as_sent=event.usage))

    def _whole(self, fact: WholeEvents) -> None:
        ttft = self.turn.ttft_s if fact.ttft_s is None else fact.ttft_s
        for event in fact.events:
            self._event(event)
        self._text_so_far()
        self.turn.ttft_s = ttft

    def _sent(self, fact: Sent) -> None:
        if self.timed:
            self.turn.chunk_times.append(round(self._elapsed(), 6))

    def _body(self, body: ChatBody) -> None:
        if body.has_choice:
            self._text.clear()
            self._reasoning.clear()
            self.turn.response_text, self.turn.reasoning_text = body.text, body.reasoning
            self.turn.tool_calls = body.tool_calls
            self.turn.finish_reason = body.finish_reason
        if body.usage is not None:
            self._counts(body.usage)
        if body.ttft_s is not None:
            self.turn.ttft_s = body.ttft_s

    def _counts(self, usage: Usage) -> None:
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
        self._text_so_far()
        if self._tool_calls:
            self.turn.tool_calls = [_joined_call(self._tool_calls[i]) for i in sorted(self._tool_calls)]
        if self.timed:
            self.turn.total_s = self._elapsed()
        return self.turn

    def _merge_tool_call(self, index: int | None, call_id: Any, name: str | None, arguments: str | None) -> None:
        # Arguments arrive in pieces like text: kept as a list, joined at `finish`.
        if index is None:
            index = len(self._tool_calls)
        slot = self._tool_calls.get(index)
        if slot is None:
            slot = self._tool_calls[index] = {"id": None, "type": "function",
                                              "function": {"name": "", "arguments": []}}
        if call_id:
            slot["id"] = call_id
        if name:
            slot["function"]["name"] += name
        if arguments:
            slot["function"]["arguments"].append(arguments)


def _joined_call(slot: dict) -> dict:
    fn = slot["function"]
    return {**slot, "function": {**fn, "arguments": "".join(fn["arguments"])}}


# Which method applies which fact: looked up by the fact's exact type, once per fact.
_APPLY = {
    ContentDelta: TurnBuilder._event, ReasoningDelta: TurnBuilder._event, ToolCallStart: TurnBuilder._event,
    ToolCallArgsDelta: TurnBuilder._event, ReplyDone: TurnBuilder._event, Usage: TurnBuilder._counts,
    Rendered: TurnBuilder._rendered, Constrained: lambda b, f: b._render({"constrained": f.forced}),
    MaxTokensClamped: lambda b, f: b._render({"max_tokens_clamped": {"asked": f.asked, "to": f.to}}),
    ReplyTokens: TurnBuilder._reply_tokens, Served: TurnBuilder._served, RenderedBy: TurnBuilder._renderer,
    Sent: TurnBuilder._sent, ChatChunk: TurnBuilder._chunk, ChatBody: TurnBuilder._body, WholeEvents: TurnBuilder._whole,
    Stop: TurnBuilder._stop, ErrorText: TurnBuilder._error, UpstreamFault: TurnBuilder._fault,
}

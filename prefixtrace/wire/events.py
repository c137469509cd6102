"""Reply events: what a model's answer is made of, whatever produced it and whatever protocol carries it.

The engine backend turns the model's output tokens into these (text, reasoning and tool calls separated by
the model family's own format); an upstream backend parses the upstream's wire events into them; each
protocol adapter writes them out in its own shape; the recorder's `Turn` is filled from them, so what is
recorded is what the client saw.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ContentDelta:
    """Visible answer text."""
    text: str


@dataclass(slots=True)
class ReasoningDelta:
    """Reasoning the model emitted (`<think>…</think>` and the like), kept apart from the answer."""
    text: str


@dataclass(slots=True)
class ToolCallStart:
    """A tool call begins: `index` counts calls within one reply from 0; `call_id` is unique."""
    index: int
    call_id: str
    name: str


@dataclass(slots=True)
class ToolCallArgsDelta:
    """More of call `index`'s arguments, as JSON text; the concatenation is the arguments object."""
    index: int
    text: str


@dataclass(slots=True)
class ReplyDone:
    """The reply ended. finish_reason in OpenAI terms: "stop" | "length" | "tool_calls" | "cancelled"."""
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None
    stop_sequence: str | None = None
    usage: dict | None = None  # the protocol's usage object as the reply carried it (an upstream's), kept as sent


@dataclass(slots=True)
class Usage:
    """The token counts a reply reports, in whichever protocol: the one way counts (and
    `cached_tokens`) reach a recorded turn. None for prompt/completion: not told here (a count
    told earlier stands); None for cached: not reported (unknown, not a cache miss).
    `as_sent`: the protocol's usage object, kept on the turn as it came (None: none was sent)."""
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    as_sent: dict | None = None


ReplyEvent = ContentDelta | ReasoningDelta | ToolCallStart | ToolCallArgsDelta | ReplyDone

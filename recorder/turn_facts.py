"""What a reply tells its turn, declared in one place: typed facts.

A reply (proxy/backend.py `Reply`) carries these beside the bytes it sends, and a backend lists
those it learns while it opens one; the relay (proxy/relay.py) alone hands them to the turn's
builder (`TurnBuilder.feed`, recorder/turn_builder.py), in the order they came, so the record is
built from what the client was sent. The reply events of prefixtrace/wire/events.py are facts too
(the answer as the client saw it, `ReplyDone` with its usage as written), and so is `Usage` (the
token counts as sent).

A fact is read and checked where it is made: `ChatChunk.read` and `ChatBody.read` raise
`ValueError` naming what is wrong with an upstream's chunk or body, so the reply that read it
decides whose fault that is, and the builder applies any fact without failing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefixtrace.wire.events import ReplyEvent, Usage

if TYPE_CHECKING:
    from recorder.renderers import RendererInfo


# --- what the engine rendered and ran (turn.render) -----------------------------------


@dataclass(slots=True)
class Rendered:
    """The prompt the engine ran (or counted): its length in characters and tokens, and the render
    policies applied to it (None: none, docs/RENDER_POLICIES.md)."""
    prompt_chars: int
    prompt_tokens: int
    policy: dict | None = None


@dataclass(slots=True)
class Constrained:
    """The reply is forced by a grammar: "tool_call", "json_schema", ... (engine/constraints.py)."""
    forced: str


@dataclass(slots=True)
class MaxTokensClamped:
    """The request's max_tokens lowered to what fits after the prompt."""
    asked: int
    to: int


@dataclass(slots=True)
class ReplyTokens:
    """The reply's token ids as the engine's cache holds them after the prompt, and the prefix cache's
    eviction count when it ended (None: not known). Kept only on a turn whose prompt was rendered."""
    token_ids: list[int]
    cache_evictions: int | None


# --- who served ------------------------------------------------------------------------


@dataclass(slots=True)
class Served:
    """Who answered: an engine, an upstream member, a router's worker."""
    by: str


@dataclass(slots=True)
class RenderedBy:
    """The renderer that built and counted the prompt, as the backend that answered knows it
    (None: not known); the recorder stores its row from the turn."""
    renderer: RendererInfo | None


# --- what went out ---------------------------------------------------------------------


@dataclass(slots=True)
class Sent:
    """One SSE event went out: a point of the turn's chunk timeline."""


SENT = Sent()  # carries nothing: one is enough


@dataclass(slots=True)
class ToolCallPiece:
    """A piece of a tool call as an OpenAI chunk streams it (any member may be missing)."""
    index: int | None  # None: the next call
    call_id: Any
    name: str | None
    arguments: str | None


@dataclass(slots=True)
class ChoicePiece:
    """What one chunk's first choice adds to the reply."""
    content: str | None
    reasoning: str | None
    calls: list[ToolCallPiece]
    finish_reason: str | None


@dataclass(slots=True)
class ChatChunk:
    """An OpenAI chat (or legacy) completion chunk as sent, read: a point of the timeline, its first
    choice's pieces and its usage (None: none in this chunk)."""
    choices: list[ChoicePiece]
    usage: Usage | None

    @classmethod
    def read(cls, chunk: dict[str, Any]) -> ChatChunk:
        choices = []
        for choice in _listed(chunk.get("choices"), "choices"):
            if not isinstance(choice, dict):
                raise ValueError("a choice is not an object")
            if choice.get("index", 0) != 0:
                continue
            delta = _object(choice.get("delta"), "delta")
            content = _content(delta.get("content") if "text" not in choice else choice["text"])
            reasoning = _text(delta.get("reasoning_content") or delta.get("reasoning"), "reasoning")
            calls = [_call_piece(_object(call, "tool call")) for call in _listed(delta.get("tool_calls"), "tool_calls")]
            finish = _text(choice["finish_reason"], "finish_reason") if choice.get("finish_reason") else None
            choices.append(ChoicePiece(content, reasoning, calls, finish))
        usage = chunk.get("usage")
        return cls(choices, openai_usage(_object(usage, "usage")) if usage else None)


@dataclass(slots=True)
class ChatBody:
    """A whole (non-streamed) chat.completion body as sent, read; `ttft_s`: the first token's time as
    the backend measured it (None: not known, the turn's stays)."""
    has_choice: bool
    text: str = ""
    reasoning: str = ""
    tool_calls: list | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    ttft_s: float | None = None

    @classmethod
    def read(cls, body: dict[str, Any], *, ttft_s: float | None = None) -> ChatBody:
        choices = _listed(body.get("choices"), "choices")
        usage = body.get("usage")
        if not choices:
            return cls(False, usage=openai_usage(_object(usage, "usage")) if usage else None, ttft_s=ttft_s)
        choice = _object(choices[0], "choice")
        message = _object(choice.get("message"), "message")
        text = _content(message.get("content")) or _text(choice.get("text"), "text") or ""
        reasoning = _text(message.get("reasoning_content") or message.get("reasoning"), "reasoning") or ""
        calls = _listed(message.get("tool_calls"), "tool_calls")
        finish = _text(choice.get("finish_reason"), "finish_reason")
        return cls(True, text, reasoning, calls or None, finish,
                   openai_usage(_object(usage, "usage")) if usage else None, ttft_s)


@dataclass(slots=True)
class WholeEvents:
    """The reply events of a whole (non-streamed) body: no first token was seen apart from the rest,
    so TTFT is what the backend measured (`ttft_s`; None: the turn's stays, None from an upstream)."""
    events: list[ReplyEvent] = field(default_factory=list)
    ttft_s: float | None = None


@dataclass(slots=True)
class Stop:
    """How the reply ended, where its protocol tells it apart from the rest (Messages' stop_reason, in
    OpenAI's terms): None keeps what was told before."""
    finish_reason: str | None


@dataclass(slots=True)
class ErrorText:
    """The reply failed, as its backend told it (in band, or an error body): the turn's error."""
    message: str


@dataclass(slots=True)
class UpstreamFault:
    """An upstream event the proxy could not read (the client got it as sent): the turn's error,
    unless it already has one (the first fault is the one kept)."""
    message: str


Fact = (ReplyEvent | Usage | Rendered | Constrained | MaxTokensClamped | ReplyTokens | Served | RenderedBy | Sent
        | ChatChunk | ChatBody | WholeEvents | Stop | ErrorText | UpstreamFault)


def openai_usage(usage: dict[str, Any]) -> Usage:
    """An OpenAI usage object (a chat chunk's or a whole body's) as the counts it tells, kept as sent."""
    details = usage.get("prompt_tokens_details") or {}
    # Unknown stays None: an upstream that does not report cached tokens must not look like one that
    # reported a cache miss.
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(usage.get("prompt_tokens"), usage.get("completion_tokens"), cached if isinstance(cached, int) else None,
                 as_sent=usage)


def _call_piece(call: dict) -> ToolCallPiece:
    fn = _object(call.get("function"), "function")
    return ToolCallPiece(call.get("index"), call.get("id"), _text(fn.get("name"), "function name"),
                         _text(fn.get("arguments"), "arguments"))


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

"""What the app and the protocol adapters ask of a backend, written down once.

Two kinds answer a turn (proxy/app.py builds the app around either):

- `EngineBackend` (proxy/engine_backend.py): the embedded engine. The proxy parses the request
  fully, renders it with the model's template and generates here (`embedded` is True).
- `UpstreamBackend` (proxy/upstream_backend.py) and `UpstreamPool` (proxy/upstream_pool.py): an
  OpenAI/Anthropic-compatible server, or several. The body goes on as the client sent it and the
  reply is read on its way back (`embedded` is False).

A protocol adapter (proxy/chat_completions.py, anthropic.py, responses.py, completions.py) reads
`backend.embedded` once, to choose how it parses and opens a turn; everything else it needs is a
method named here. The split mirrors httpx's transports: the adapters never look for attributes
to guess which kind they hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, NamedTuple, Protocol, runtime_checkable

from recorder.turn_facts import Fact

if TYPE_CHECKING:  # typing only: upstream mode never imports the engine (nor MLX)
    import httpx

    from engine.engine import Engine
    from proxy.chat_request import ChatRequest
    from proxy.engine_backend import EngineChat


class WholeReply(NamedTuple):
    """A whole (non-streamed) reply: the body as sent, its content type, and the facts it tells its
    turn (recorder/turn_facts.py), in order."""
    data: bytes
    content_type: str
    facts: list[Fact]


class Reply(Protocol):
    """An opened reply, whatever the protocol (proxy/relay.py `respond` sends it).

    What it tells its turn travels with what it sends, as typed facts (recorder/turn_facts.py): `sse`
    yields them between the bytes, `whole` returns them with the body, and the facts learnt while the
    reply opened were listed by its backend (`open(..., learnt)`); the relay alone feeds them to the
    turn's builder, in order, so a chunk's point on the timeline is where it went out."""

    status: int
    # The upstream (or pool member) that answered; None on the engine.
    url: str | None
    # Set by the relay: called by a reply that can tell its turn is complete before the end marker
    # (an upstream's usage chunk); a reply that never can simply never calls it.
    on_final: Callable[[], None] | None

    @property
    def streams_events(self) -> bool: ...

    @property
    def stage(self) -> str | None:
        """How far the request got (queued, prefilling, decoding, upstream_body); None: not known."""

    def cancel(self) -> None: ...

    def sse(self) -> AsyncIterator[bytes | Fact]:
        """The streamed reply's SSE events as sent, each preceded by the facts it tells (only called
        when `streams_events`)."""

    async def whole(self) -> WholeReply: ...


@runtime_checkable
class Backend(Protocol):
    """Every backend: what the app's routes, the dashboard and the adapters call."""

    # True: the embedded engine (parse, render, generate here); False: forwarded upstream as sent.
    embedded: bool

    @property
    def label(self) -> str:
        """Names the backend in recorded turns (`upstream`), /health and logs."""

    @property
    def max_context_tokens(self) -> int | None:
        """The context limit sent as `X-Max-Context-Tokens` (None: none known here)."""

    async def ready(self) -> bool: ...

    async def capacity(self) -> dict: ...

    async def models(self) -> dict: ...

    def renderer_identity(self) -> dict[str, Any] | None:
        """The chat template the embedded engine renders with (`GET /props`); None upstream."""

    def stats(self) -> list[dict] | None:
        """Per-upstream counters of a pool (dashboard, /metrics); None for one server or the engine."""

    async def aclose(self) -> None:
        """Release connections and tasks when the app stops."""


@runtime_checkable
class EmbeddedBackend(Backend, Protocol):
    """The embedded engine's backend: what the adapters call when `embedded` is True."""

    engine: Engine

    async def open(self, req: ChatRequest, headers: dict[str, str], learnt: list[Fact], *,
                   wait_first: bool = True) -> EngineChat:
        """Render `req` and submit it; its reply events come from the returned `EngineChat`. What the
        open learns for the turn (the render, the renderer, who serves) is appended to `learnt` as it
        is learnt, so a refused or abandoned open still tells it."""

    async def open_prompt(self, req: ChatRequest, prompt: str, learnt: list[Fact]) -> EngineChat:
        """Legacy completions: a raw prompt, no chat template."""

    async def render(self, req: ChatRequest, *, count_only: bool = False) -> Any:
        """The rendered prompt (text and token ids) the engine would run for `req`."""


@runtime_checkable
class ForwardingBackend(Backend, Protocol):
    """An upstream (or a pool of them): what the adapters call when `embedded` is False."""

    async def post(self, path: str, body: dict, headers: dict[str, str], *, session_id: str | None = None,
                   raw: bytes | None = None) -> tuple[httpx.Response, str]:
        """`body` POSTed to `path` as sent; the streamed response and the URL that answered."""

    def renderer_of(self, url: str) -> Any:
        """The `RendererInfo` (recorder/renderers.py) of the upstream that answered at `url`: the template it
        published, which built the turn's prompt; None when it published none."""

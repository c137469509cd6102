"""`Turn`: everything the proxy knows about one request/response pair.

This dataclass is the only thing the proxy hands to the recorder. The proxy
fills it while it serves; the recorder decides how it is stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from recorder.renderers import RendererInfo


@dataclass
class Turn:
    request_id: str
    started_at: float  # unix seconds when the request arrived
    endpoint: str  # "/v1/chat/completions"
    upstream: str  # "embedded:<model name>" or the upstream base URL
    request_body: Any  # parsed JSON body (dict), or the raw text when it did not parse
    request_headers: dict[str, str] = field(default_factory=dict)  # unfiltered; the recorder redacts
    session_id: str | None = None  # X-Session-Id, `user` or `prompt_cache_key`; None = infer later
    client_addr: str | None = None
    stream: bool = False
    status: int = 0  # HTTP status sent to the client
    error: str | None = None  # reason when status >= 400, or "client disconnected"
    response_text: str = ""
    reasoning_text: str = ""
    tool_calls: list[dict] | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # None = upstream did not say (never record unknown as 0)
    usage: dict | None = None  # the usage object exactly as sent to the client
    ttft_s: float | None = None  # time to first content token
    total_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds since start, one per SSE chunk
    render: dict | None = None  # engine-side facts: {"prompt_tokens", "reply_token_ids", "cache_evictions", …}
    # What rendered and counted the prompt: the id of a `renderers` row (recorder/renderers.py), whose
    # chat template and tokenizer the analyzer uses by default. None = not known (an upstream that
    # publishes no template, or a turn recorded before this was kept).
    renderer_id: str | None = None
    # That renderer itself, as the backend that answered knows it (TurnBuilder.on_renderer), or as an
    # imported file carries it: the recorder stores its `renderers` row from here. None on a turn read back
    # from a database (its row is there already). Not part of equality: `renderer_id` names it.
    renderer: RendererInfo | None = field(default=None, compare=False, repr=False)
    served_by: str | None = None  # the upstream member URL or engine that answered (a pool names one of several)
    # `serve --fix`: one entry per named fix ({"name", "fired", "note", "bytes_before", "bytes_after"},
    # analyzer/fixes); `request_body` is then the body as sent upstream. Stored inside `render`.
    fixes: list[dict] | None = None
    # The body's exact JSON text when known (JSONL/HAR import, or a proxy that
    # passes it on): the recorder stores it byte for byte when it parses to
    # `request_body`. Not part of equality: it is another spelling of the body.
    request_raw: str | None = field(default=None, compare=False, repr=False)

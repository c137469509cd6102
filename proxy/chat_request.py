"""The request every protocol adapter produces: a chat-completions request, parsed and validated.

Validation happens here, once, before any backend sees the request, so a bad
request fails with a 400 and a reason whichever backend serves it. The body's
JSON itself is read by proxy/request_limits.py (`parse_body`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixtrace.wire.sampling import SamplingParams
from prefixtrace.common.errors import InvalidRequest


@dataclass(slots=True)
class ChatRequest:
    body: dict  # the body as the client sent it, for pass-through and recording
    model: str | None
    messages: list
    stream: bool
    include_usage: bool
    tools: list | None
    chat_template_kwargs: dict | None
    sampling: SamplingParams
    session_id: str | None
    # The reply's shape, read by the engine (engine/constraints.py); upstream mode passes the body on.
    tool_choice: Any = None
    response_format: Any = None
    reasoning_effort: str | None = None
    # `body` as the client's bytes (set by `proxy.relay.serve_turn` when `body` is the parsed request
    # as it came): an upstream is sent these rather than `body` encoded again.
    raw: bytes | None = None
    # The client's query string (`api-version=...`), forwarded upstream with the body (proxy/upstream_query.py).
    query: str = ""


def parse_chat_request(body: dict, headers: dict[str, str] | None = None) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty array", param="messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise InvalidRequest("'tools' must be an array", param="tools")
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict):  # the chat template raises a bare ValueError on these
            raise InvalidRequest(f"tools[{i}] must be an object, got {type(tool).__name__}", param="tools")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InvalidRequest("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):  # the upstream backend merges into it
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    headers = {k.lower(): v for k, v in (headers or {}).items()}
    return ChatRequest(
        body=body,
        model=body.get("model"),
        messages=messages,
        stream=bool(body.get("stream", False)),
        include_usage=bool(stream_options.get("include_usage")),
        tools=tools,
        chat_template_kwargs=kwargs,
        sampling=_sampling(body),
        session_id=headers.get("x-session-id") or _str_or_none(body.get("user")) or _str_or_none(body.get("prompt_cache_key")),
        tool_choice=body.get("tool_choice"),
        response_format=body.get("response_format"),
        reasoning_effort=_str_or_none(body.get("reasoning_effort")),
    )


def _sampling(body: dict) -> SamplingParams:
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        max_tokens=None if max_tokens is None else _int(max_tokens, "max_tokens"),
        seed=None if body.get("seed") is None else _seed(body["seed"]),
        stop=list(stop) if isinstance(stop, list) else _bad("stop", "a string or an array of strings"),
        ignore_eos=bool(body.get("ignore_eos", False)),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
    )


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _bad(key, "a number")
    return float(value)


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _bad(key, "an integer")
    return value


def _seed(value: Any) -> int:
    # OpenAI takes any 64-bit signed seed; the engine's RNG key is unsigned 64-bit
    # and an out-of-range seed failed the engine step, so fold negatives (two's
    # complement) and refuse what fits neither.
    seed = _int(value, "seed")
    if not -(2**63) <= seed < 2**64:
        _bad("seed", "an integer in [-2**63, 2**64)")
    return seed % 2**64


def _bad(key: str, expected: str):
    raise InvalidRequest(f"'{key}' must be {expected}", param=key)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def passthrough_request(body: dict, session_id: str | None) -> ChatRequest:
    """A request the proxy forwards as sent (upstream mode of a non-chat protocol): only what the
    proxy itself reads (`stream`, the model name, the session) is looked at here; the rest is the
    upstream's to judge."""
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    return ChatRequest(body=body, model=body.get("model") if isinstance(body.get("model"), str) else None,
                       messages=[], stream=bool(body.get("stream", False)), include_usage=False, tools=None,
                       chat_template_kwargs=None, sampling=SamplingParams(), session_id=session_id)

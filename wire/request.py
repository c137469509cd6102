"""One internal view of a request, whatever protocol carried it.

`normalize_request(endpoint, body)` turns a chat-completions, Messages, Responses or legacy
completions body into a `WireRequest`: the conversation as chat messages (system first, as the
engine renders it), tools in chat's nested function shape, the system text, and the
chat-completions body the engine is given (`chat_body`). The proxy, the analyzer's loader and
the recorder's importers use it, so every protocol is read the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.errors import InvalidRequest
from wire import completions, messages, responses

CHAT_PATH = "/v1/chat/completions"


@dataclass(slots=True)
class WireRequest:
    protocol: str  # "chat" | "messages" | "responses" | "completions"
    body: dict  # as the client sent it
    chat_body: dict  # the chat-completions body the engine renders (completions: {"prompt": ...})
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    system: str = ""  # the leading system message(s), joined
    prompt: str | list | None = None  # legacy completions only

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def protocol_of(endpoint: str | None) -> str:
    """Which protocol an endpoint speaks ("chat" for anything unrecognised, as recorded history is)."""
    path = (endpoint or CHAT_PATH).split("?", 1)[0].rstrip("/")
    if path == messages.PATH or path == messages.COUNT_TOKENS_PATH:
        return "messages"
    if path == responses.PATH:
        return "responses"
    if path == completions.PATH:
        return "completions"
    return "chat"


def session_id(endpoint: str | None, body: Any, headers: dict[str, str] | None) -> str | None:
    """The session a request belongs to, as its protocol's clients say it (headers first), also
    for a body that does not parse as a request (so a failed turn keeps its session)."""
    body = body if isinstance(body, dict) else {}
    protocol = protocol_of(endpoint)
    if protocol == "messages":
        found = messages.session_id(body, headers or {})
    elif protocol == "responses":
        found = responses.session_id(body, headers or {})
    else:
        found = None
    if found:
        return found
    lower = {k.lower(): v for k, v in (headers or {}).items()}
    for value in (lower.get("x-session-id"), body.get("user"), body.get("prompt_cache_key")):
        if isinstance(value, str) and value:
            return value
    return None


def normalize_request(endpoint: str | None, body: Any, previous: list[dict] | None = None) -> WireRequest:
    """The internal request for `body` as sent to `endpoint`; InvalidRequest when it is not one."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    protocol = protocol_of(endpoint)
    if protocol == "messages":
        chat = messages.to_chat_body(body)
    elif protocol == "responses":
        chat = responses.to_chat_body(body, previous)
    elif protocol == "completions":
        prompt = completions.prompt_of(body)
        return WireRequest("completions", body, {**body, "prompt": prompt}, prompt=prompt)
    else:
        chat = body
        if not isinstance(chat.get("messages"), list):
            raise InvalidRequest("'messages' is required and must be a non-empty array", param="messages")
    msgs = chat.get("messages") or []
    system = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer"):
            break
        system.append(joined_text(m.get("content")))
    return WireRequest(protocol, body, chat, msgs, chat.get("tools"), "\n\n".join(system))


def joined_text(content: Any) -> str:
    """A message's text: the string, or its text parts joined; anything else is no text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""

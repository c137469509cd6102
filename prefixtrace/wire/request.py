"""What every protocol's request has in common, read the same way by all who read it: which
protocol an endpoint speaks (`protocol_of`: the recorder's replay and HAR import), the session a
request belongs to (`session_id`: the proxy, for refused requests too), a message's text
(`joined_text`: the engine's render policy).

Each protocol's body becomes the chat-completions body the engine renders in its own adapter
(proxy/anthropic.py with `messages.to_chat_body`, proxy/responses.py with `responses.to_chat_body`,
proxy/completions.py with `completions.prompt_of`); chat completions is that shape already.
"""

from __future__ import annotations

from typing import Any

from prefixtrace.wire import completions, messages, responses

CHAT_PATH = "/v1/chat/completions"


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


def is_remote_compaction(endpoint: Any) -> bool:
    """A turn of OpenAI's `/v1/responses/compact`: the server rewrote the history; its effect is the
    next call's (a `compaction` item it carries), the request itself is no call of the loop."""
    return isinstance(endpoint, str) and endpoint.split("?", 1)[0].rstrip("/") == responses.COMPACT_PATH


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


def joined_text(content: Any) -> str:
    """A message's text: the string, or its text parts joined; anything else is no text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""

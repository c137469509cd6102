"""`session-key` (cause: server_miss across a fleet, a session's turns landing on workers that never
saw its prefix): a stable routing key on every request of the session.

OpenAI routes by `prompt_cache_key` (chat completions, Responses), legacy completions by `user`,
Anthropic by `metadata.user_id`; routers in front of self-hosted fleets read headers (Dynamo's
`X-Dynamo-Session-ID`). The fix sets the session's id where the client set none, and the header
beside it. A key the client set is its own choice: the fix stands aside. The model reads none of it.
"""

from __future__ import annotations

import copy

from analyzer.fixes.base import Outcome, SessionRecord, stands_aside

NAME = "session-key"
ROUTER_HEADERS = ("X-Dynamo-Session-ID",)
BODY_KEY = {"chat": "prompt_cache_key", "responses": "prompt_cache_key", "completions": "user"}


def fix(body: dict, protocol: str, record: SessionRecord) -> Outcome:
    key = record.session_id
    if not key:
        return stands_aside("the request names no session (no session header, user or key)")
    headers = {h: key for h in ROUTER_HEADERS}
    new = copy.copy(body)
    if protocol == "messages":
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            return stands_aside("`metadata` is not an object")
        if isinstance(metadata, dict) and metadata.get("user_id"):
            return Outcome(None, "the client set its own metadata.user_id", headers=headers)
        new["metadata"] = {**(metadata or {}), "user_id": key}
        return Outcome(new, "session key set (metadata.user_id)", headers=headers)
    field = BODY_KEY.get(protocol, "prompt_cache_key")
    if body.get(field):
        return Outcome(None, f"the client set its own {field}", headers=headers)
    new[field] = key
    return Outcome(new, f"session key set ({field})", headers=headers)

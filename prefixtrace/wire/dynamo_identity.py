"""The session and parent session NVIDIA Dynamo's router reads from a request's headers, so the proxy
can say them in Dynamo's own headers (`X-Dynamo-Session-ID`, `X-Dynamo-Parent-Session-ID`).

Dynamo takes a request's agent identity from its canonical headers when `X-Dynamo-Session-ID` is
present, and from the harness's own headers only when it is absent (ai-dynamo/dynamo
lib/llm/src/protocols/agents.rs, `agent_context_header_values`). A proxy that sends the canonical
session header therefore hides the harness's parent: this module resolves both as Dynamo would from
the client's headers, and the proxy sends the result. The rules, mirrored from that file:

- the client's own `X-Dynamo-Session-ID` (and its `X-Dynamo-Parent-Session-ID`) win;
- Claude Code: `x-claude-code-session-id`; a sub-agent adds `x-claude-code-agent-id` (its session) and
  `x-claude-code-parent-agent-id` (its parent), the root session being the parent when that is absent;
- Codex: `thread-id`, parent `x-codex-parent-thread-id`;
- DeepSeek's harness: `x-deepseek-harness-session-id`, parent `x-deepseek-harness-parent-session-id`;
- opencode: `x-session-id`, parent `x-parent-session-id`;
- a parent equal to the session is no parent.

Dynamo has no header for a request's parent request: its parent is a session's (a sub-agent's) parent
session. A side request that only the analysis recognises (a title generation under the main session's
id, a memory extraction with no id) has no parent here: nothing in the request says it at the time.
"""

from __future__ import annotations

from typing import NamedTuple

SESSION_HEADER = "x-dynamo-session-id"
PARENT_HEADER = "x-dynamo-parent-session-id"

# (root session header, child session header, parent session header, root is a child's parent)
_AGENT_HEADERS = (
    ("x-claude-code-session-id", "x-claude-code-agent-id", "x-claude-code-parent-agent-id", True),
    ("thread-id", None, "x-codex-parent-thread-id", False),
    ("x-deepseek-harness-session-id", None, "x-deepseek-harness-parent-session-id", False),
    ("x-session-id", None, "x-parent-session-id", False),
)


class DynamoIdentity(NamedTuple):
    session: str
    parent: str | None


def _value(headers: dict[str, str], name: str) -> str | None:
    value = headers.get(name)
    value = value.strip() if isinstance(value, str) else ""
    return value or None


def dynamo_identity(headers: dict[str, str]) -> DynamoIdentity | None:
    """The (session, parent session) Dynamo would read from `headers`; None when they name no session."""
    lower = {k.lower(): v for k, v in headers.items()}
    session = _value(lower, SESSION_HEADER)
    if session is not None:
        parent = _value(lower, PARENT_HEADER)
        return DynamoIdentity(session, parent if parent != session else None)
    for root_header, child_header, parent_header, root_is_parent in _AGENT_HEADERS:
        root = _value(lower, root_header)
        if root is None:
            continue
        session = (_value(lower, child_header) if child_header else None) or root
        parent = _value(lower, parent_header)
        if parent == session or (root_is_parent and session == root):
            parent = None
        if parent is None and root_is_parent and session != root:
            parent = root
        return DynamoIdentity(session, parent)
    return None

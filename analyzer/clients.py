"""Which harness sent a request, and what its conversation is about: the names a person knows a
session by ("pi · “fix the flaky test”"), instead of `inferred-1`.

The User-Agent names most harnesses (claude-cli, opencode, QwenCode, codex). Some send only their
SDK's (pi: `OpenAI/JS` or `Anthropic/JS`; aider and llm: `OpenAI/Python`), so the request itself
decides between them where it can: pi's and aider's system prompts say who they are. What cannot be
told apart is named by its SDK ("OpenAI/Python"), never guessed.
"""

from __future__ import annotations

import re
from typing import Any

from recorder.redact import DEFAULT_REDACTOR

_BY_AGENT = (  # (User-Agent pattern, client)
    (re.compile(r"claude-cli|claude-code", re.I), "claude-code"),
    (re.compile(r"^opencode/", re.I), "opencode"),
    (re.compile(r"qwencode|qwen-code", re.I), "qwen-code"),
    (re.compile(r"codex", re.I), "codex"),
    (re.compile(r"^aider", re.I), "aider"),
    (re.compile(r"^llm/", re.I), "llm"),
    (re.compile(r"^pi[/ ]|pi-coding-agent", re.I), "pi"),
)
_BY_SYSTEM = (  # (system-prompt pattern, client) for harnesses that send their SDK's User-Agent
    (re.compile(r"operating inside pi, a coding agent harness"), "pi"),
    (re.compile(r"^Act as an expert software developer\.", re.M), "aider"),
    (re.compile(r"You are Qwen Code"), "qwen-code"),
    (re.compile(r"You are a Claude agent|You are Claude Code"), "claude-code"),
    (re.compile(r"You are opencode|You are a title generator"), None),  # opencode's own UA already says so
)
KNOWN = frozenset(name for _, name in _BY_AGENT)
TITLE_CHARS = 80


def _text(content: Any, skip_reminders: bool = False) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
                        and not (skip_reminders and p["text"].lstrip().startswith("<system-reminder>")))
    return ""


def _system(body: dict) -> str:
    parts = [_text(body.get("system")), _text(body.get("instructions"))]
    for m in body.get("messages") or body.get("input") or []:
        if isinstance(m, dict) and m.get("role") in ("system", "developer"):
            parts.append(_text(m.get("content")))
    return "\n".join(p for p in parts if p)


def client_of(user_agent: str | None, body: Any = None) -> str | None:
    """"pi", "claude-code", "codex", "opencode", "qwen-code", "aider", "llm", else the User-Agent's
    product ("OpenAI/Python"), else None."""
    ua = (user_agent or "").strip()
    for pattern, name in _BY_AGENT:
        if pattern.search(ua):
            return name
    if isinstance(body, dict):
        system = _system(body)
        for pattern, name in _BY_SYSTEM:
            if name and pattern.search(system):
                return name
    if not ua:
        return None
    product = ua.split()[0]
    name, _, version = product.rpartition("/")
    return name if name and version[:1].isdigit() else product


_SIDE = re.compile(r"title generator|generate a (?:short |brief )?title|messages above are a conversation to summari"
                   r"|summari[sz]e (?:this|the) conversation", re.I)


def is_side_request(body: Any) -> bool:
    """A harness's side request (a title generator, a summariser), which must not name the session."""
    if not isinstance(body, dict):
        return False
    return bool(_SIDE.search(_system(body)) or _SIDE.search(title_of(body, 400) or ""))


def title_of(body: Any, limit: int = TITLE_CHARS) -> str | None:
    """What the person asked, on one line, trimmed to `limit` chars: the last user message of the
    request (of a conversation's first request, the question; the user messages before it are the
    harness's preamble: Qwen Code's context, aider's worked examples)."""
    if not isinstance(body, dict):
        return None
    messages = body.get("messages")
    if messages is None and isinstance(body.get("input"), list):
        messages = body["input"]
    elif messages is None and isinstance(body.get("input"), str):
        messages = [{"role": "user", "content": body["input"]}]
    for m in reversed(messages or []):
        if isinstance(m, dict) and m.get("role") == "user":
            # Claude Code opens with <system-reminder> parts that no person typed.
            text = " ".join(_text(m.get("content"), skip_reminders=True).split()).strip("\"“”")
            if not text:
                continue
            text = DEFAULT_REDACTOR.text(text)  # before the cut: a cut secret matches no pattern
            return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"
    return None

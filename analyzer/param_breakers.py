"""Request parameters that break a provider's cache without changing the prompt's text
(`param_change/<parameter>`, docs/ANALYZER.md "Parameter breakers").

A provider keys its cache on more than the prompt: Anthropic invalidates cached messages when
`tool_choice`, the thinking settings, images, or the effort change, and the system prompt as well when
web search, citations or the speed (fast mode) are toggled; OpenAI routes by `prompt_cache_key`. None of
these shows in a rendered prompt, so the rendered comparison calls such a turn append-only. This module
reads them from the body as the client sent it (before it is read into the chat shape) and from the
recorded headers, and names the first one that changed, with both values.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# How far a change invalidates, in the provider's cache hierarchy (tools -> system -> messages):
# "messages" keeps the tools and the system prompt, "system" keeps the tools, "all" keeps nothing.
ANTHROPIC_RULES: dict[str, str] = {
    "tool_choice": "messages",
    "thinking.type": "messages",
    "thinking.budget_tokens": "messages",
    "output_config.effort": "messages",
    "images": "messages",
    "speed": "system",
    "web_search": "system",
    "citations": "system",
    "anthropic-beta": "all",
}
OPENAI_RULES: dict[str, str] = {
    "prompt_cache_key": "all",  # another key routes to another cache machine
    "reasoning_effort": "all",
    "reasoning.effort": "all",
}
SOURCES = {
    "anthropic": "Anthropic prompt caching, \"What invalidates the cache\" "
                 "(platform.claude.com/docs/en/build-with-claude/prompt-caching)",
    "openai": "OpenAI prompt caching (platform.openai.com/docs/guides/prompt-caching)",
    "local": "the chat template renders chat_template_kwargs",
}


@dataclass
class ParamChange:
    name: str  # "tool_choice", "thinking.budget_tokens", "chat_template_kwargs.enable_thinking"
    before: Any
    after: Any
    level: str  # "messages", "system" or "all": what the provider drops
    provider: str  # "anthropic", "openai" or "local"

    def text(self, value: Any) -> str:
        return f"{self.name}: {'(unset)' if value is None else json.dumps(value, sort_keys=True)}"


def _get(body: dict, dotted: str) -> Any:
    value: Any = body
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _blocks(body: dict):
    """Every content block of the messages (and a block-list system prompt)."""
    system = body.get("system")
    if isinstance(system, list):
        yield from (b for b in system if isinstance(b, dict))
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        for b in content if isinstance(content, list) else []:
            if isinstance(b, dict):
                yield b
                inner = b.get("content")  # a tool_result's own blocks
                yield from (c for c in (inner if isinstance(inner, list) else []) if isinstance(c, dict))


def anthropic_params(body: dict, headers: dict | None) -> dict[str, Any]:
    """The Messages request's cache-relevant parameters as the client sent them."""
    out = {name: _get(body, name) for name in ("tool_choice", "thinking.type", "thinking.budget_tokens",
                                                "output_config.effort", "speed")}
    blocks = list(_blocks(body))
    out["images"] = any(b.get("type") == "image" for b in blocks)
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    out["web_search"] = any(isinstance(t, dict) and str(t.get("type", "")).startswith("web_search") for t in tools)
    out["citations"] = any(isinstance(b.get("citations"), dict) and b["citations"].get("enabled") is True
                           for b in blocks)
    beta = next((v for k, v in (headers or {}).items() if k.lower() == "anthropic-beta"), None)
    out["anthropic-beta"] = sorted({b.strip() for b in str(beta).split(",") if b.strip()}) if beta else None
    return out


def openai_params(body: dict) -> dict[str, Any]:
    return {name: _get(body, name) for name in OPENAI_RULES}


def local_params(body: dict) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    return {f"chat_template_kwargs.{k}": v for k, v in kwargs.items()} if isinstance(kwargs, dict) else {}


def provider_rules(endpoint: str | None, upstream: str | None) -> str | None:
    """Whose documented rules apply: a Messages request not served by the embedded engine is Anthropic's
    (a plain JSONL without an upstream, or a harness transcript, is taken as sent to Anthropic); an OpenAI
    upstream, or a Responses request without one or rebuilt from a transcript (Codex), OpenAI's."""
    up = (upstream or "").lower()
    if up.startswith("embedded:"):
        return None
    if endpoint == "/v1/messages":
        return "anthropic"
    if "openai.com" in up or "openai.azure.com" in up or (
            (not up or up.startswith("transcript:")) and endpoint == "/v1/responses"):
        return "openai"
    return None


def cache_params(body: Any, endpoint: str | None, headers: dict | None, upstream: str | None) -> dict | None:
    """{"provider", "values"} of a raw request body, or None when it is not a JSON object."""
    if not isinstance(body, dict):
        return None
    provider = provider_rules(endpoint, upstream)
    values = local_params(body)
    if provider == "anthropic":
        values.update(anthropic_params(body, headers))
    elif provider == "openai":
        values.update(openai_params(body))
    return {"provider": provider, "values": values}


def first_change(prev: dict | None, now: dict | None) -> ParamChange | None:
    """The first documented parameter that changed between two requests' `cache_params`."""
    if not prev or not now:
        return None
    provider = now["provider"]
    rules = ANTHROPIC_RULES if provider == "anthropic" else OPENAI_RULES if provider == "openai" else {}
    if prev["provider"] == provider:
        for name, level in rules.items():
            a, b = prev["values"].get(name), now["values"].get(name)
            if a != b and not (a in (None, False) and b in (None, False)):
                return ParamChange(name, a, b, level, provider)
    for name in sorted(set(prev["values"]) | set(now["values"])):
        if name.startswith("chat_template_kwargs.") and prev["values"].get(name) != now["values"].get(name):
            return ParamChange(name, prev["values"].get(name), now["values"].get(name), "rendered", "local")
    return None


def fix_text(change: ParamChange) -> str:
    """What to do about it, naming the parameter and where the provider's cache breaks."""
    kept = {"messages": "the cached conversation (the tools and system prompt stay cached)",
            "system": "the cached system prompt and conversation (only the tools stay cached)",
            "all": "the whole cached prefix", "rendered": "the rendered prompt from where it changed"}[change.level]
    who = {"anthropic": "Anthropic drops", "openai": "OpenAI loses", "local": "the chat template re-renders"}
    before, after = (json.dumps(v, sort_keys=True) for v in (change.before, change.after))
    return (f"{change.name} changed within the session ({before} → {after}) and {who[change.provider]} {kept}: "
            f"choose it once per session and keep it fixed; where it must change (a one-off forced tool, a "
            f"harder step), send that request as a side request and return to the session's value")


def kept_prefix(level: str, rendered, count: Callable[[str], int]) -> tuple[int, int]:
    """(tokens, chars) of the previous prefix the provider keeps: for "messages", the rendering before the
    first conversation message (the tools and the system prompt); nothing otherwise (the rendering does
    not separate the tools from the system prompt, so a "system" change is priced as losing both)."""
    if level != "messages":
        return 0, 0
    head = 0
    while head < len(rendered.roles) and rendered.roles[head] in ("system", "developer"):
        head += 1
    text = []
    for segment, owner in zip(rendered.segments, rendered.owners):
        if owner >= head:
            break
        text.append(segment)
    joined = "".join(text)
    return (count(joined), len(joined)) if joined else (0, 0)

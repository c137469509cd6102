"""The server's own counts (docs/ANALYZER.md "The server's own counts"): where requests carry the
provider's usage, what a break lost, and why the server kept less, come from those counts, never
from the rebuilt prompt's tokenizer (a transcript's rebuilt prompt lacks the system prompt and
tools: its counts run 2-3x low).

Anthropic's prompt is `input_tokens + cache_read_input_tokens + cache_creation_input_tokens`;
OpenAI's is `input_tokens` (Responses) or `prompt_tokens` (Chat Completions), of which
`cached_input_tokens` / `*_tokens_details.cached_tokens` were read from cache (analyzer/load.py and
recorder/transcripts/ read them into `reported_prompt_tokens` / `reported_cached_tokens`).
"""

from __future__ import annotations

from typing import Any

# A server-side loss this big (tokens, the server's own count) is reported whatever its share of the
# prompt: 5k tokens re-prefilled is seconds on any server (`--min-partial-loss`).
PARTIAL_LOSS_MIN = 5000

# The harness whose transcript a turn was rebuilt from names the provider whose cache lifetime applies
# (recorder/transcripts/common.py UPSTREAM_PREFIX); harnesses that talk to any provider (pi,
# opencode) are told by the model's name.
TRANSCRIPT_PREFIX = "transcript:"
HARNESS_PROVIDERS = {"claude-code": "anthropic", "codex": "openai"}


def server_lost(prev_req: Any, req: Any) -> int | None:
    """Tokens the server would have read from cache had it kept the previous request's prompt (at
    most this prompt's length), less what it read: the server's own counts. None when a count is
    missing (then only the rebuilt prompt's estimate is left)."""
    prev_prompt = getattr(prev_req, "reported_prompt_tokens", None)
    prompt, cached = getattr(req, "reported_prompt_tokens", None), getattr(req, "reported_cached_tokens", None)
    if prev_prompt is None or prompt is None or cached is None:
        return None
    return max(0, min(prev_prompt, prompt) - cached)


# The shortest prompt each hosted provider caches at all (Anthropic: 1,024 tokens for Sonnet and Opus,
# 2,048 for Haiku; OpenAI: 1,024): below it a "miss" is the rule, not a loss.
MIN_CACHEABLE = {"anthropic": 1024, "openai": 1024}


def too_short_to_cache(prev_req: Any, req: Any) -> bool:
    """Whether the shorter of the two prompts, by the server's count, is below what its provider caches."""
    from analyzer.causes import provider_of

    model = req.body.get("model") if isinstance(getattr(req, "body", None), dict) else None
    minimum = MIN_CACHEABLE.get(provider_of(getattr(req, "upstream", None), model if isinstance(model, str) else None))
    a, b = getattr(prev_req, "reported_prompt_tokens", None), getattr(req, "reported_prompt_tokens", None)
    return minimum is not None and a is not None and b is not None and min(a, b) < minimum


def input_fell(prev_req: Any, req: Any) -> tuple[int, int] | None:
    """(previous, this) prompt counts by the server when this request's count is below the previous
    one's: the server saw a shorter prompt although the client sent a longer one."""
    a, b = getattr(prev_req, "reported_prompt_tokens", None), getattr(req, "reported_prompt_tokens", None)
    return (a, b) if a is not None and b is not None and b < a else None


def transcript_provider(upstream: str | None, model: str | None) -> str | None:
    """The provider a transcript's harness called, by the model's name (a transcript does not hold the
    base URL: Claude Code or Codex pointed at a local server names that server's model, which has no
    lifetime); by the harness only when the transcript names no model."""
    if not (upstream or "").startswith(TRANSCRIPT_PREFIX):
        return None
    name = (model or "").lower().rsplit("/", 1)[-1]
    if not name:
        return HARNESS_PROVIDERS.get(upstream[len(TRANSCRIPT_PREFIX):])
    if name.startswith("claude"):
        return "anthropic"
    if name.startswith(("gpt-", "o1", "o3", "o4", "codex")):
        return "openai"
    return None


def asked_long_lifetime(req: Any) -> bool:
    """Whether the request asked for, or the server reports writing, the provider's long cache
    lifetime: Anthropic `cache_control` ttl "1h" (or usage's `cache_creation.ephemeral_1h_input_tokens`),
    OpenAI `prompt_cache_retention: "24h"`."""
    if getattr(req, "cache_ttl_1h", False):
        return True
    usage = getattr(req, "usage", None)
    creation = usage.get("cache_creation") if isinstance(usage, dict) else None
    if isinstance(creation, dict) and (creation.get("ephemeral_1h_input_tokens") or 0) > 0:
        return True
    body = getattr(req, "body", None)
    return isinstance(body, dict) and body.get("prompt_cache_retention") == "24h"


def gap_text(seconds: float) -> str:
    """"6 min 12 s", "10 h 3 min", "45 s"."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def reasoning_drop_text(fell: tuple[int, int], new_user_turn: bool) -> str:
    return (f"the server counted {fell[1]:,} input tokens, {fell[0] - fell[1]:,} fewer than the previous "
            f"request's {fell[0]:,}, while the client only appended"
            + (" a new user turn" if new_user_turn else "")
            + ": the server dropped earlier reasoning from the prompt (a thinking strip done server-side)")


TOKEN_BASES = {
    "server": "the server's own counts (its usage)",
    "estimate": "an estimate: the rebuilt prompt counted by the analysis's tokenizer (no usage from the server)",
}


def cached_text(t: Any) -> str:
    """What the server read from cache against what it could have, each clause in one unit: the
    server's tokens, or the rebuilt prompt's (never one against the other)."""
    read, prompt = t.reported_cached_tokens, t.reported_prompt_tokens
    if read is None:
        return "the server did not report its cached tokens"
    server = f"the server read {read:,} of this prompt's {prompt:,} tokens from cache" if prompt is not None \
        else f"the server read {read:,} tokens from cache"
    if getattr(t, "lost_tokens_basis", None) == "server" or t.predicted_cached_tokens is None:
        return server
    rebuilt = f"{t.predicted_cached_tokens:,} of its {t.prompt_tokens or 0:,}"
    return f"{server}; the rebuilt prompt predicted {rebuilt} cached (the analysis's tokens)"

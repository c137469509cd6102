"""A coding-agent session whose system prompt carries a per-turn timestamp, played against a proxy: the
measurement behind `--fix volatile` (docs/FIXES.md "Measured"), shared by its test and bench script."""

from __future__ import annotations

import httpx

RULES = "".join(f"Rule {i}: keep the change small, run the tests, explain what you did and why. " for i in range(12))


def system_prompt(turn: int) -> str:
    # The timestamp near the top, as harnesses that print "the current time" before their rules do.
    return f"You are a coding agent. Current time: 2026-12-04 10:{turn:02d}:{(turn * 7) % 60:02d} UTC.\n{RULES}"


def play(url: str, turns: int = 6, max_tokens: int = 4) -> list[dict]:
    """Sends the session's turns in order (each with the history so far and the replies as received);
    returns each turn's usage as the proxy reported it."""
    history: list[dict] = []
    usages = []
    with httpx.Client(timeout=900) as client:
        for turn in range(turns):
            history.append({"role": "user", "content": f"Step {turn}: edit file_{turn}.py and rerun the tests."})
            body = {"model": "default", "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "system", "content": system_prompt(turn)}, *history]}
            r = client.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "volatile-demo"})
            r.raise_for_status()
            reply = r.json()
            history.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""})
            usages.append(reply["usage"])
    return usages


def cached_share(usages: list[dict]) -> float:
    """Cached over prompt tokens across turns 2 and later."""
    later = usages[1:]
    prompt = sum(u["prompt_tokens"] for u in later)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in later)
    return cached / prompt if prompt else 0.0

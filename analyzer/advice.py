"""What a harness author can do about each cause: one concrete suggestion per break (what to move
where), shown beside what the break cost (`lost_seconds`, `lost_tokens`: docs/ANALYZER.md "Cost").
The text follows the real difference: a volatile value is named with its kind and both values, a
template effect never gets a client-side fix."""

from __future__ import annotations

from recorder.redact import DEFAULT_REDACTOR

_ADVICE = {
    ("system_rewrite", "volatile"): "the system prompt carries a ticking value (counter, time, date, id): "
                                    "move it out of the system prompt into a short note appended at the end of the "
                                    "conversation, or leave it out; the system prompt must be byte-identical every turn",
    ("system_rewrite", None): "the system prompt was rewritten: keep it fixed for the session and append changed "
                              "instructions (todo state, memory, mode) as a new message at the end instead",
    ("system_fold", None): "a mid-conversation system message is rendered into the head by this template: send it as "
                           "a user-role note at the end of the conversation (or serve with --mid-system inline)",
    ("thinking_strip", "template"): "the template drops earlier reasoning at a new user-role message: send harness "
                                    "notices (todo updates, subagent results) as tool results rather than user "
                                    "messages, or render with chat_template_kwargs preserve_thinking",
    ("thinking_strip", "template_empty"): "the chat template renders an empty <think></think> block in assistant "
                                          "turns after the last user message and drops it once a newer user message "
                                          "follows: send no reasoning rather than an empty or whitespace-only one "
                                          "(reasoning_content, thinking blocks), or serve with a template that renders "
                                          "past assistant turns as it rendered the newest (e.g. chat_template_kwargs "
                                          "preserve_thinking where the template has it)",
    ("thinking_strip", "client"): "the client stopped sending an earlier turn's reasoning: keep sending past "
                                  "reasoning_content unchanged (or never send it)",
    ("tools_change", None): "the tool list changed and tools render at the head of the prompt: keep one fixed tool "
                            "list for the whole session (register every tool up front); announce availability in a "
                            "message instead of editing the list",
    ("history_edit", None): "an earlier message was edited: never rewrite history in place; shorten old tool output "
                            "only at a compaction point",
    ("compaction", None): "expected when the context fills: keep the system prompt and tools byte-identical across "
                          "the compaction so at least they stay cached, and compact less often",
    ("dropped_message", None): "earlier messages were dropped: keep them in the history (they are cheap once "
                               "cached), or drop them only at a compaction",
    ("request_local_tail", None): "the previous request ended with a one-shot message that is gone now: leave such "
                                  "reminders in the history once sent, or put them after the newest message only "
                                  "in the request that needs them and keep them there",
    ("param_change", None): "a parameter that changes the rendered prompt changed (model, chat_template_kwargs, "
                            "reasoning): keep it fixed within a session; another model never shares a cache",
    ("serialization", "tools"): "the same tools were sent in other bytes (key order, strict: false): send tool "
                                "definitions byte-identically every request, whichever API carries them",
    ("serialization", "template"): "only the rendering changed: the chat template renders the same messages "
                                   "differently from one request to the next (nothing the client sent differs before "
                                   "this point); compare the two sides below and serve with a template that renders "
                                   "earlier turns the same way every time",
    ("server_miss", "eviction"): "the client kept the prefix; the server evicted it for room: give the prefix cache "
                                 "more memory (serve --cache-bytes) or a disk tier (--cache-dir), or run fewer "
                                 "sessions at once",
    ("server_miss", "routing"): "the client kept the prefix; another upstream served this turn and does not hold it: "
                                "pin a session to one upstream (send X-Session-Id or prompt_cache_key)",
    ("server_miss", "ttl"): "the client kept the prefix; it expired on the provider between turns: use the 1 hour "
                            "cache lifetime (Anthropic cache_control ttl \"1h\"; OpenAI prompt_cache_retention "
                            "\"24h\") for sessions with long pauses",
    ("server_miss", "reasoning_drop"): "the client kept the prefix; the provider removed earlier reasoning from the "
                                       "prompt it built (its input count fell), so everything after the first dropped "
                                       "reasoning item was prefilled again: nothing to change in the harness; pass the "
                                       "reasoning back in full (e.g. encrypted reasoning content with store: false) "
                                       "where the provider keeps it across user turns, or count this cost as the "
                                       "provider's",
    ("server_miss", None): "the client kept the prefix; the server did not serve it from cache: nothing to change in "
                           "the harness; look at the server's cache size, routing and lifetime",
    ("serialization", None): "same content, other bytes (key order, whitespace): resend earlier messages exactly as "
                             "first sent (keep the JSON text, do not re-serialise)",
}


VOLATILE_NAMES = {
    "counter": "a counter", "timestamp": "a timestamp", "uuid": "a UUID", "hex_id": "a hex id",
    "email": "an e-mail address", "url_query": "a URL query string",
    "high_entropy": "a random-looking token (nonce, request id, signature)",
}


def _short(value: str, limit: int = 40) -> str:
    """`value` quoted, cut to `limit`. Redacted first: a cut secret no longer matches its pattern
    (a GitHub token cut to 39 characters is too short for `ghp_` + 36), so whatever redacts the fix
    text later (the dashboard, OTLP spans) would let its first 39 characters through."""
    value = DEFAULT_REDACTOR.text(value)
    return repr(value if len(value) <= limit else value[: limit - 1] + "…")


def volatile_advice(cause: str, volatile: dict, where: str | None = None) -> str:
    """The fix for a break whose only change is a volatile value: what it is, where, and where it goes."""
    what = (f"{VOLATILE_NAMES.get(volatile.get('kind'), 'a volatile value')} that changes between requests "
            f"({_short(str(volatile.get('before')))} → {_short(str(volatile.get('after')))})")
    if cause == "system_rewrite":
        return (f"the system prompt carries {what}: move it out of the system prompt into a short note appended "
                f"at the end of the conversation, or leave it out; the system prompt must be byte-identical every turn")
    if cause == "tools_change":
        return (f"the tool definition {where or ''} carries {what}: keep tool definitions byte-identical for the "
                f"whole session and send the changing value in a message at the end instead").replace("  ", " ")
    return (f"{where or 'an earlier message'} carries {what}, rewritten after it was first sent: resend earlier "
            f"messages exactly as first sent; generate such a value once and keep it, or put it only in the "
            f"newest message")


def suggestion(cause: str, subtype: str | None, volatile: dict | None = None, where: str | None = None) -> str:
    if volatile:
        return volatile_advice(cause, volatile, where)
    return _ADVICE.get((cause, subtype)) or _ADVICE.get((cause, None), "")


SIDE_REQUEST = ("send side requests (titles, summaries, memory extraction) with the main chain's system prompt and "
                "tools and their instruction as the last message, so they reuse its cached prefix")

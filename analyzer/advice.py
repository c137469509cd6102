"""What a harness author can do about each cause: one concrete suggestion per break (what to move
where), shown beside the tokens fixing it would save (`break.saves_tokens`: the previous prompt's
tokens past the common prefix, which a cache would have served had the prompt only grown)."""

from __future__ import annotations

_ADVICE = {
    ("system_rewrite", "volatile"): "the system prompt carries a ticking value (counter, time, date, percentage): "
                                    "move it out of the system prompt into a short note appended at the end of the "
                                    "conversation, or leave it out; the system prompt must be byte-identical every turn",
    ("system_rewrite", None): "the system prompt was rewritten: keep it fixed for the session and append changed "
                              "instructions (todo state, memory, mode) as a new message at the end instead",
    ("system_fold", None): "a mid-conversation system message is rendered into the head by this template: send it as "
                           "a user-role note at the end of the conversation (or serve with --mid-system inline)",
    ("thinking_strip", "template"): "the template drops earlier reasoning at a new user-role message: send harness "
                                    "notices (todo updates, subagent results) as tool results rather than user "
                                    "messages, or render with chat_template_kwargs preserve_thinking",
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
    ("server_miss", "eviction"): "the client kept the prefix; the server evicted it for room: give the prefix cache "
                                 "more memory (serve --cache-bytes) or a disk tier (--cache-dir), or run fewer "
                                 "sessions at once",
    ("server_miss", "routing"): "the client kept the prefix; another upstream served this turn and does not hold it: "
                                "pin a session to one upstream (send X-Session-Id or prompt_cache_key)",
    ("server_miss", "ttl"): "the client kept the prefix; it expired on the provider between turns: use the 1 hour "
                            "cache lifetime (Anthropic cache_control ttl \"1h\") for sessions with long pauses",
    ("server_miss", None): "the client kept the prefix; the server did not serve it from cache: nothing to change in "
                           "the harness; look at the server's cache size, routing and lifetime",
    ("serialization", None): "same content, other bytes (key order, whitespace): resend earlier messages exactly as "
                             "first sent (keep the JSON text, do not re-serialise)",
}


def suggestion(cause: str, subtype: str | None) -> str:
    return _ADVICE.get((cause, subtype)) or _ADVICE.get((cause, None), "")


SIDE_REQUEST = ("send side requests (titles, summaries, memory extraction) with the main chain's system prompt and "
                "tools and their instruction as the last message, so they reuse its cached prefix")

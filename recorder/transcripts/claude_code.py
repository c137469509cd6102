"""Claude Code: `~/.claude/projects/<cwd with / as ->/<session id>.jsonl`, one JSON object a line.

What it holds: every message of the conversation (`type` `user` / `assistant`, the Messages API
`message` object as sent or received, `uuid`/`parentUuid`, `sessionId`, `timestamp`), the reply's
`usage`, and bookkeeping lines (`queue-operation`, `summary`, `system`, `file-history-snapshot`,
`attachment`, …) that were never sent. An assistant reply streamed as several content blocks is
written as several lines sharing `message.id`: together they are one model call.

What it does not hold: the system prompt, the tool definitions and the request's parameters
(`max_tokens`, `thinking`, `metadata`, …), the `<system-reminder>` context block Claude Code puts
before the first user message, the "Output token limit hit" user message it sends after a reply cut
by `max_tokens`, and `cache_control` markers. Side requests (title, summaries) are not written.
Seen on the wire and mirrored here: a reply that was all empty text is not sent back, and user lines
that follow one another (a tool result, then a prompt) travel as one user message.
"""

from __future__ import annotations

from pathlib import Path

from recorder.transcripts.common import (Transcript, int_or_none, make_turn, openai_call, parse_time,
                                         read_jsonl_lines)

HARNESS = "claude-code"
ENDPOINT = "/v1/messages"
MESSAGE_TYPES = ("user", "assistant")
STOP = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def looks_like(objs: list[dict]) -> bool:
    return any(o.get("type") in MESSAGE_TYPES and "sessionId" in o and "uuid" in o and isinstance(o.get("message"), dict)
               for o in objs)


def _reply_id(obj: dict) -> str:
    msg = obj["message"]
    return str(msg.get("id") or obj.get("requestId") or obj.get("uuid"))


def _is_message(obj: dict) -> bool:
    return obj.get("type") in MESSAGE_TYPES and isinstance(obj.get("message"), dict)


def _synthetic(obj: dict) -> bool:
    """A reply Claude Code wrote itself (an API error shown as a message): no model call."""
    return obj.get("type") == "assistant" and (obj["message"].get("model") == "<synthetic>"
                                               or bool(obj.get("isApiErrorMessage")))


def read(path: Path) -> list[Transcript]:
    """One model call per reply (`message.id`), in file order. Each call's history is the chain of
    `parentUuid` links from its reply back to the conversation's root (or to a compact boundary),
    so a rewound or branched conversation gives each call the history it really had."""
    lines = [obj for _, obj in read_jsonl_lines(path)]
    by_uuid = {o["uuid"]: o for o in lines if isinstance(o.get("uuid"), str)}
    replies: dict[tuple[str, str], list[dict]] = {}  # (session, message id) -> its lines, in file order
    order: list[tuple[str, str]] = []
    sessions: dict[str, Transcript] = {}
    for obj in lines:
        sid = obj.get("sessionId")
        if not isinstance(sid, str) or not _is_message(obj):
            continue
        if sid not in sessions:
            t = sessions[sid] = Transcript(HARNESS, sid, str(path))
            t.note("system prompt not in the transcript")
            t.note("tool definitions not recorded")
            t.note("request parameters (max_tokens, thinking, metadata) not recorded")
            t.note("the <system-reminder> context Claude Code adds to the first user message is not in the transcript")
        t = sessions[sid]
        if obj.get("isSidechain"):
            t.note("sub-agent (sidechain) messages skipped: their requests are another conversation")
            continue
        if obj["type"] != "assistant":
            continue
        if _synthetic(obj):
            t.note("synthetic assistant messages (API errors written by Claude Code) skipped: no model call")
            continue
        key = (sid, _reply_id(obj))
        if key not in replies:
            replies[key] = []
            order.append(key)
        replies[key].append(obj)
    for sid, mid in order:
        t = sessions[sid]
        first = replies[(sid, mid)][0]
        chain = _ancestors(t, first, by_uuid)
        history = _history(t, chain)
        # the reply's line is written when it arrives; the request left right after the line before it
        sent = parse_time(chain[-1].get("timestamp")) if chain else None
        _emit(t, _merged(replies[(sid, mid)]), sent if sent is not None else parse_time(first.get("timestamp")),
              history)
    return [t.finish() for t in sessions.values() if t.turns]


def _ancestors(t: Transcript, obj: dict, by_uuid: dict[str, dict]) -> list[dict]:
    """The lines before `obj` in its conversation, oldest first."""
    chain: list[dict] = []
    seen = {obj.get("uuid")}
    parent = obj.get("parentUuid")
    while isinstance(parent, str):
        line = by_uuid.get(parent)
        if line is None or parent in seen:
            t.note("the history before a message is missing from the file (its parent is not there)")
            break
        seen.add(parent)
        chain.append(line)
        parent = line.get("parentUuid")
    chain.reverse()
    if chain and chain[0].get("type") == "system" and chain[0].get("subtype") == "compact_boundary":
        t.note("compacted: the history before the compact boundary was replaced by its summary, as sent")
    return chain


def _merged(lines: list[dict]) -> dict:
    """One reply from its lines (Claude Code writes a streamed reply one content block a line)."""
    msg = dict(lines[0]["message"])
    msg["content"] = [b for line in lines for b in _blocks(line["message"].get("content"))]
    for line in lines:
        if isinstance(line["message"].get("usage"), dict):
            msg["usage"] = line["message"]["usage"]
        if line["message"].get("stop_reason"):
            msg["stop_reason"] = line["message"]["stop_reason"]
    return msg


def _history(t: Transcript, chain: list[dict]) -> list[dict]:
    """The messages of a chain as Claude Code sends them (seen on the wire): a reply that was all
    empty text is not sent back, and user lines that follow one another travel as one message."""
    out: list[dict] = []
    i = 0
    while i < len(chain):
        obj = chain[i]
        i += 1
        if not _is_message(obj) or obj.get("isSidechain") or _synthetic(obj):
            continue
        if obj["type"] == "user":
            out.append({"role": "user", "content": obj["message"].get("content")})
            continue
        group = [obj]
        while i < len(chain) and _is_message(chain[i]) and chain[i]["type"] == "assistant" \
                and _reply_id(chain[i]) == _reply_id(obj):
            group.append(chain[i])
            i += 1
        reply = _merged(group)
        if all(b.get("type") == "text" and not b.get("text") for b in reply["content"]):
            continue
        if out and out[-1]["role"] == "assistant" and out[-1].get("_stop") == "max_tokens":
            t.note("the user message Claude Code sends after a reply cut by max_tokens is not in the transcript: "
                   "the request after it ends with that reply")
        out.append({"role": "assistant", "content": reply["content"], "_stop": reply.get("stop_reason")})
    if out and out[-1]["role"] == "assistant" and out[-1].get("_stop") == "max_tokens":
        t.note("the user message Claude Code sends after a reply cut by max_tokens is not in the transcript: "
               "the request after it ends with that reply")
    return _merge_roles([{k: v for k, v in m.items() if k != "_stop"} for m in out])


def _blocks(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content or [] if isinstance(b, dict)]


def _emit(t: Transcript, msg: dict, ts: float | None, history: list[dict]) -> None:
    body = {"model": msg.get("model"), "messages": history}
    blocks = msg["content"]
    text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
    reasoning = "".join(b.get("thinking", "") for b in blocks if b.get("type") == "thinking")
    calls = [openai_call(b.get("id"), b.get("name"), b.get("input", {})) for b in blocks if b.get("type") == "tool_use"]
    usage = msg.get("usage") if isinstance(msg.get("usage"), dict) else None
    prompt = cached = completion = None
    if usage:
        fresh, read_ = int_or_none(usage.get("input_tokens")), int_or_none(usage.get("cache_read_input_tokens"))
        written = int_or_none(usage.get("cache_creation_input_tokens"))
        prompt = None if fresh is None else fresh + (read_ or 0) + (written or 0)
        cached = read_
        completion = int_or_none(usage.get("output_tokens"))
    t.turns.append(make_turn(t, len(t.turns) + 1, ts, ENDPOINT, body, text=text, reasoning=reasoning,
                             tool_calls=calls, finish_reason=STOP.get(msg.get("stop_reason")), prompt_tokens=prompt,
                             completion_tokens=completion, cached_tokens=cached, usage=usage))


def _merge_roles(messages: list[dict]) -> list[dict]:
    """Consecutive user lines (a tool result, then the next prompt) are one user message on the
    wire, as the Messages API requires alternating roles."""
    out: list[dict] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"] == "user":
            out[-1] = {"role": "user", "content": _blocks(out[-1]["content"]) + _blocks(m["content"])}
        else:
            out.append(m)
    return out

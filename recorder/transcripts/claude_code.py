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


def read(path: Path) -> list[Transcript]:
    lines = read_jsonl_lines(path)
    sessions: dict[str, Transcript] = {}
    history: dict[str, list[dict]] = {}
    pending: dict[str, tuple[str, dict, float | None, list[dict]]] = {}  # session -> (message id, msg, ts, history)
    # A reply's line is written when it arrives; the request left right after the line before it.
    last_ts: dict[str, float | None] = {}
    last_stop: dict[str, str | None] = {}  # stop reason of the last reply in the history

    def session(sid: str) -> Transcript:
        if sid not in sessions:
            t = Transcript(HARNESS, sid, str(path))
            t.note("system prompt not in the transcript")
            t.note("tool definitions not recorded")
            t.note("request parameters (max_tokens, thinking, metadata) not recorded")
            t.note("the <system-reminder> context Claude Code adds to the first user message is not in the transcript")
            sessions[sid] = t
            history[sid] = []
        return sessions[sid]

    def flush(sid: str) -> None:
        if sid not in pending:
            return
        _, msg, ts, before = pending.pop(sid)
        t = sessions[sid]
        _emit(t, msg, ts, before)
        if all(b.get("type") == "text" and not b.get("text") for b in msg["content"]):
            return  # an empty reply is not sent back: the next user text joins the user turn before it
        history[sid].append({"role": "assistant", "content": msg["content"]})
        last_stop[sid] = msg.get("stop_reason")

    for _lineno, obj in lines:
        sid = obj.get("sessionId")
        kind = obj.get("type")
        if not isinstance(sid, str):
            continue
        if kind == "system" and obj.get("subtype") == "compact_boundary":
            t = session(sid)
            flush(sid)
            history[sid] = []
            t.note("compacted: the history before the compact boundary was replaced by its summary, as sent")
            continue
        if kind not in MESSAGE_TYPES or not isinstance(obj.get("message"), dict):
            continue
        t = session(sid)
        if obj.get("isSidechain"):
            t.note("sub-agent (sidechain) messages skipped: their requests are another conversation")
            continue
        msg = obj["message"]
        ts = parse_time(obj.get("timestamp"))
        sent, last_ts[sid] = last_ts.get(sid), ts
        if kind == "assistant":
            if msg.get("model") == "<synthetic>" or obj.get("isApiErrorMessage"):
                t.note("synthetic assistant messages (API errors written by Claude Code) skipped: no model call")
                continue
            mid = msg.get("id") or obj.get("requestId") or obj.get("uuid")
            if sid in pending and pending[sid][0] == mid:  # another content block of the same reply
                pending[sid][1]["content"] = [*pending[sid][1]["content"], *_blocks(msg.get("content"))]
                if isinstance(msg.get("usage"), dict):
                    pending[sid][1]["usage"] = msg["usage"]
                if msg.get("stop_reason"):
                    pending[sid][1]["stop_reason"] = msg["stop_reason"]
                continue
            flush(sid)
            if history[sid] and history[sid][-1]["role"] == "assistant" and last_stop.get(sid) == "max_tokens":
                t.note("the user message Claude Code sends after a reply cut by max_tokens is not in the transcript: "
                       "the request after it ends with that reply")
            merged = {**msg, "content": _blocks(msg.get("content"))}
            pending[sid] = (mid, merged, sent if sent is not None else ts, list(history[sid]))
            continue
        flush(sid)
        content = msg.get("content")
        history[sid].append({"role": "user", "content": content})
    for sid in list(pending):
        flush(sid)
    return [t.finish() for t in sessions.values() if t.turns]


def _blocks(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content or [] if isinstance(b, dict)]


def _emit(t: Transcript, msg: dict, ts: float | None, before: list[dict]) -> None:
    body = {"model": msg.get("model"), "messages": _merge_roles(before)}
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

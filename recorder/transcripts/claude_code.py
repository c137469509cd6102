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

from recorder.transcripts.claude_code_chain import (attachment_message, result_ids, with_parallel_results,
                                                    with_preserved_segment)
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
    linear = _link_linear(lines)
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
            if sid in linear:
                t.note("no parentUuid links in the file: each message's history is the messages before it")
            t.note("system prompt not in the transcript")
            t.note("tool definitions not recorded")
            t.note("request parameters (max_tokens, thinking, metadata) not recorded")
            t.note("the <system-reminder> context Claude Code adds to the first user message is not in the transcript")
        t = sessions[sid]
        if isinstance(obj.get("version"), str):  # Claude Code stamps each line with its version
            t.harness_version = obj["version"]
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
    histories = _Histories(by_uuid)
    for sid, mid in order:
        t = sessions[sid]
        first = replies[(sid, mid)][0]
        history = histories.before(t, first)
        # the reply's line is written when it arrives; the request left right after the line before it
        parent = by_uuid.get(first.get("parentUuid") or "")
        sent = parse_time(parent.get("timestamp")) if parent else None
        _emit(t, _merged(replies[(sid, mid)]), sent if sent is not None else parse_time(first.get("timestamp")),
              history)
        t.call_keys[t.turns[-1].request_id] = mid  # the reply's id: the same call in another file is the same
    versions = _versions(lines)
    for t in sessions.values():
        t.version = versions.get(t.session_id, "")
    return [t.finish() for t in sessions.values() if t.turns]


def _versions(lines: list[dict]) -> dict[str, str]:
    """Per session, the Claude Code versions that wrote it ("2.0.46", or "1.0.0 to 1.0.24" for a
    session resumed by a newer one); "" where lines carry none."""
    seen: dict[str, set[str]] = {}
    for o in lines:
        if isinstance(o.get("sessionId"), str) and isinstance(o.get("version"), str):
            seen.setdefault(o["sessionId"], set()).add(o["version"])

    def key(v: str) -> tuple:
        return tuple(int(x) if x.isdigit() else 0 for x in v.split("."))
    return {sid: " to ".join(dict.fromkeys([min(vs, key=key), max(vs, key=key)])) for sid, vs in seen.items()}


def _link_linear(lines: list[dict]) -> set[str]:
    """Sessions whose messages carry no `parentUuid` at all (early or hand-written files): each of
    their message lines is linked to the message line before it in the same session, so its history
    is what the file holds before it. Returns those sessions."""
    linked = {o.get("sessionId") for o in lines if isinstance(o.get("uuid"), str) and o.get("parentUuid")}
    last: dict[str, str | None] = {}
    for o in lines:
        sid = o.get("sessionId")
        if _is_message(o) and isinstance(o.get("uuid"), str) and isinstance(sid, str) and sid not in linked:
            o["parentUuid"] = last.get(sid)
            last[sid] = o["uuid"]
    return set(last)


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


MAX_TOKENS_NOTE = ("the user message Claude Code sends after a reply cut by max_tokens is not in the transcript: "
                   "the request after it ends with that reply")


class _Histories:
    """Each call's history: the messages on the chain of `parentUuid` links from its reply back to
    the root (or a compact boundary), as Claude Code sends them (seen on the wire): a reply that was
    all empty text is not sent back, and user lines that follow one another travel as one message.

    A call's history usually extends the previous call's, so the walk stops at the first line whose
    history is already known and only the lines after it are converted: linear in the file, not
    quadratic, and every call's list shares the message objects."""

    def __init__(self, by_uuid: dict[str, dict]):
        self.by_uuid = by_uuid
        self.known: dict[str, tuple[list[dict], str | None]] = {}  # line uuid -> (messages up to it, trailing stop)
        self.results: dict[str, list[dict]] | None = None  # line uuid -> the tool-result lines whose parent it is

    def _results_of(self, uuid: str) -> list[dict]:
        if self.results is None:
            self.results = {}
            for o in self.by_uuid.values():
                if o.get("type") == "user" and isinstance(o.get("parentUuid"), str) and result_ids(o):
                    self.results.setdefault(o["parentUuid"], []).append(o)
        return self.results.get(uuid, [])

    def before(self, t: Transcript, first: dict) -> list[dict]:
        key = first.get("parentUuid")
        lines: list[dict] = []
        base: tuple[list[dict], str | None] = ([], None)
        seen = {first.get("uuid")}
        parent = key
        while isinstance(parent, str):
            if parent in self.known:
                base = self.known[parent]
                break
            line = self.by_uuid.get(parent)
            if line is None or parent in seen:
                t.note("the history before a message is missing from the file (its parent is not there)")
                break
            seen.add(parent)
            lines.append(line)
            parent = line.get("parentUuid")
        lines = with_parallel_results(with_preserved_segment(lines[::-1], self.by_uuid.get), _reply_id, self._results_of)
        if lines and parent is None and lines[0].get("type") == "system" and lines[0].get("subtype") == "compact_boundary":
            t.note("compacted: the history before the compact boundary was replaced by its summary, as sent")
            t.mark_compacted()
        messages, stop = list(base[0]), base[1]
        attachments: list[dict] = []
        i = 0
        while i < len(lines):
            obj = lines[i]
            i += 1
            if (attached := attachment_message(obj)) is not None:
                attachments.append(attached)  # sent after the user message its run of user lines makes
                continue
            if not _is_message(obj) or obj.get("isSidechain") or _synthetic(obj):
                continue
            if obj["type"] == "user":
                msg = {"role": "user", "content": obj["message"].get("content")}
                if messages and messages[-1]["role"] == "user":  # the Messages API alternates roles
                    msg = {"role": "user", "content": _blocks(messages[-1]["content"]) + _blocks(msg["content"])}
                    messages[-1] = msg
                else:
                    messages.append(msg)
                stop = None
                continue
            messages.extend(attachments)
            attachments.clear()
            group = [obj]
            while i < len(lines) and _is_message(lines[i]) and lines[i]["type"] == "assistant" \
                    and _reply_id(lines[i]) == _reply_id(obj):
                group.append(lines[i])
                i += 1
            reply = _merged(group)
            if all(b.get("type") == "text" and not b.get("text") for b in reply["content"]):
                continue
            if stop == "max_tokens":
                t.note(MAX_TOKENS_NOTE)
            messages.append({"role": "assistant", "content": reply["content"]})
            stop = reply.get("stop_reason")
        messages.extend(attachments)
        if stop == "max_tokens":
            t.note(MAX_TOKENS_NOTE)
        if isinstance(key, str):
            self.known[key] = (messages, stop)
        return _without_concurrent(t, messages, stop)


CONCURRENT_NOTE = ("replies to concurrent requests are interleaved in the file (one reply's parent is another "
                   "reply): each request rebuilt without the replies that came back while it was in flight")


def _without_concurrent(t: Transcript, messages: list[dict], stop: str | None) -> list[dict]:
    """Claude Code never sends a request ending with an assistant message (but after a reply cut by
    max_tokens, whose follow-up is not in the file). A chain ending with one is a reply to a request
    sent at the same time, written before this one's: it was not part of this request."""
    end = len(messages)
    if stop == "max_tokens":
        return list(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    if end < len(messages):
        t.note(CONCURRENT_NOTE)
    return messages[:end]


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

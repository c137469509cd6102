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
Seen on the wire and mirrored here: a reply that was all empty text is not sent back, user lines
that follow one another (a tool result, then a prompt) travel as one user message, a local command's
stdout (a `system` line) is sent as a user message, and the synthetic "No response requested." reply
Claude Code writes after a local command on resuming is sent back (an API error's is not).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

from recorder.transcripts.claude_code_chain import result_ids
from recorder.transcripts.claude_code_history import (Histories, Line, is_message, local_command_output, merged,
                                                      reply_id, synthetic)
from recorder.transcripts.common import (Stream, StreamPosition, Transcript, held, int_or_none, make_turn,
                                         openai_call, parse_time)
from recorder.transcripts.lines import JsonLines, LinesAt

HARNESS = "claude-code"
ENDPOINT = "/v1/messages"
MESSAGE_TYPES = ("user", "assistant")
STOP = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def looks_like(objs: list[dict]) -> bool:
    return any(o.get("type") in MESSAGE_TYPES and "sessionId" in o and "uuid" in o and isinstance(o.get("message"), dict)
               for o in objs)


def read(path: Path) -> list[Transcript]:
    """The file's sessions, their turns held (as every reader gives them)."""
    return held(stream(path))


def stream(path: Path) -> Stream:
    """One model call per reply (`message.id`), in file order. Each call's history is the chain of
    `parentUuid` links from its reply back to the conversation's root (or to a compact boundary),
    so a rewound or branched conversation gives each call the history it really had.

    Read in two passes, neither holding the file: the first keeps where each line lies and its
    parent (a reply's lines may be apart, and a rewind may point at any earlier line); the second
    rebuilds the calls in order, reading back only the lines a call's history adds (`Histories`).
    Both run as the turns are asked for, so a bad line or an interrupt in the first stops the
    import as one in the second does; the sessions are listed once the first pass is done."""
    lines = JsonLines(path)
    sessions: list[Transcript] = []
    where = StreamPosition(lines.size)
    return Stream(sessions, _calls(path, lines, sessions, where), where)


class _Index:
    """The first pass: per line with a `uuid`, where it lies and its parent; per reply, where its
    lines lie; per session, its notes and versions."""

    def __init__(self, path: Path, reader: JsonLines, where: StreamPosition):
        self.path = path
        self.lines: dict[str, Line] = {}
        self.replies: dict[tuple[str, str], list[int]] = {}  # (session, message id) -> its lines' offsets
        self.local_outputs: dict[str, list[int]] = {}  # parent uuid -> local command outputs, in file order
        self.results: dict[str, list[int]] = {}  # parent uuid -> tool-result lines, in file order
        self.sessions: dict[str, Transcript] = {}
        linked: set = set()  # sessions with any parentUuid link
        unlinked: dict[str, list[str]] = {}  # message uuids in order, per session without links so far
        versions: dict[str, set[str]] = {}
        self.size = reader.size
        for where.lineno, obj in reader:
            where.position = reader.position
            sid, uuid = obj.get("sessionId"), obj.get("uuid")
            if isinstance(uuid, str):
                parent = obj.get("parentUuid")
                # one string object per uuid, shared by its key and its children's parent field
                self.lines[sys.intern(uuid)] = Line(reader.start, sys.intern(parent) if isinstance(parent, str) else parent)
                if obj.get("parentUuid"):
                    linked.add(sid)
                    unlinked.pop(sid, None)
                elif is_message(obj) and isinstance(sid, str) and sid not in linked:
                    unlinked.setdefault(sid, []).append(uuid)
            if isinstance(sid, str) and isinstance(obj.get("version"), str):
                versions.setdefault(sid, set()).add(obj["version"])
            if local_command_output(obj) and isinstance(obj.get("parentUuid"), str):
                self.local_outputs.setdefault(obj["parentUuid"], []).append(reader.start)
            if obj.get("type") == "user" and isinstance(obj.get("parentUuid"), str) and result_ids(obj):
                self.results.setdefault(sys.intern(obj["parentUuid"]), []).append(reader.start)
            if isinstance(sid, str) and is_message(obj):
                self._message(sid, obj, reader.start)
        for sid, uuids in unlinked.items():
            self._link_linear(uuids)
            self.sessions[sid].notes.insert(0, "no parentUuid links in the file: each message's history is the "
                                               "messages before it")
        for sid, t in self.sessions.items():
            t.version = _version_range(versions.get(sid, set()))

    def _message(self, sid: str, obj: dict, start: int) -> None:
        if sid not in self.sessions:
            t = self.sessions[sid] = Transcript(HARNESS, sid, str(self.path))
            t.note("system prompt not in the transcript")
            t.note("tool definitions not recorded")
            t.note("request parameters (max_tokens, thinking, metadata) not recorded")
            t.note("the <system-reminder> context Claude Code adds to the first user message is not in the transcript")
        t = self.sessions[sid]
        if isinstance(obj.get("version"), str):  # Claude Code stamps each line with its version
            t.harness_version = obj["version"]
        if obj.get("isSidechain"):
            t.note("sub-agent (sidechain) messages skipped: their requests are another conversation")
        elif obj["type"] == "assistant" and synthetic(obj):
            t.note("synthetic assistant messages (written by Claude Code, not a model) are no model call")
        elif obj["type"] == "assistant":
            self.replies.setdefault((sid, reply_id(obj)), []).append(start)

    def _link_linear(self, uuids: list[str]) -> None:
        """A session whose messages carry no `parentUuid` at all (early or hand-written files): each
        message line is linked to the message line before it, so its history is what the file holds
        before it."""
        for prev, uuid in zip([None, *uuids], uuids):
            self.lines[uuid] = self.lines[uuid]._replace(parent=prev)


def _version_range(seen: set[str]) -> str:
    """The Claude Code versions that wrote a session ("2.0.46", or "1.0.0 to 1.0.24" for a session
    resumed by a newer one); "" where lines carry none."""
    if not seen:
        return ""

    def key(v: str) -> tuple:
        return tuple(int(x) if x.isdigit() else 0 for x in v.split("."))
    return " to ".join(dict.fromkeys([min(seen, key=key), max(seen, key=key)]))


def _calls(path: Path, lines: JsonLines, sessions: list[Transcript], where: StreamPosition) -> Iterator:
    """The first pass, then the second: each reply's call, in the order of its first line."""
    index = _Index(path, lines, where)
    sessions.extend(index.sessions.values())
    where.lineno = None  # the second pass reads by offset: the stop message names the bytes
    at = LinesAt(path)
    histories = Histories(index.lines, index.local_outputs, index.results, at)
    try:
        for (sid, mid), starts in list(index.replies.items()):
            del index.replies[(sid, mid)]
            t = index.sessions[sid]
            where.position = starts[0]
            lines = [histories.read_at(start) for start in starts]
            first = lines[0]
            own = index.lines.get(first.get("uuid")) if isinstance(first.get("uuid"), str) else None
            parent = own.parent if own is not None else first.get("parentUuid")
            history, compacted = histories.before(t, parent, first.get("uuid"))
            # the reply's line is written when it arrives; the request left right after the line before it
            sent = parse_time(histories.read(parent).get("timestamp")) \
                if isinstance(parent, str) and parent in index.lines else None
            turn = _turn(t, merged(lines), sent if sent is not None else parse_time(first.get("timestamp")), history)
            t.call_keys[turn.request_id] = mid  # the reply's id: the same call in another file is the same
            if (kept := t.kept(turn, compacted=compacted)) is not None:
                yield kept
        where.position = index.size
    finally:
        at.close()


def _turn(t: Transcript, msg: dict, ts: float | None, history: list[dict]):
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
    return make_turn(t, t.calls + 1, ts, ENDPOINT, body, text=text, reasoning=reasoning, tool_calls=calls,
                     finish_reason=STOP.get(msg.get("stop_reason")), prompt_tokens=prompt,
                     completion_tokens=completion, cached_tokens=cached, usage=usage)

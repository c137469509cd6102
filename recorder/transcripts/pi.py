"""pi (@mariozechner/pi-coding-agent): `~/.pi/agent/sessions/<cwd as --a-b-->/<time>_<session id>.jsonl`.

What it holds: a `session` header line (`id`, `cwd`, `timestamp`), settings changes (`model_change`,
`thinking_level_change`) and one `message` line per conversation message in pi's own shape: `user`
(text and image parts), `assistant` (`text`, `thinking` and `toolCall` parts, the `api` and
`model` it was sent with, `usage`, `stopReason`), `toolResult` (`toolCallId`, text parts),
`bashExecution` (a `!` command the user ran), `compaction` entries (a summary and the first entry
kept). Lines link by `id`/`parentId` (a tree: pi can branch a session); a call's history is its
chain of parents. The header's `version` names the format: 1 (absent; entries without ids, one
linear chain, compactions naming a line index), 2 (ids), 3 (role `hookMessage` renamed `custom`).

Rebuilt for the `openai-completions` API the way pi-ai's `convertMessages` writes it (default
compat): user text parts as content parts, assistant text as one string with `tool_calls`
(arguments JSON-encoded), tool results as `role: "tool"` messages. What it does not hold: the system
prompt, the tool definitions, request parameters (`max_tokens`, `stream_options`), provider compat
switches that change the wire shape, and messages pi adds from extensions or custom entries.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

from prefixtrace.common.errors import InvalidRequest
from recorder.transcripts.common import Stream, Transcript, held, int_or_none, make_turn, openai_call, parse_time
from recorder.transcripts.lines import JsonLines, LinesAt

HARNESS = "pi"
ENDPOINT = "/v1/chat/completions"  # every call is rebuilt in this API's form (a note says when it was another)
STOP = {"stop": "stop", "length": "length", "toolUse": "tool_calls", "aborted": "cancelled"}


SUPPORTED_VERSIONS = (1, 2, 3)
# pi's own texts for the messages it adds (packages/coding-agent/src/core/messages.ts)
COMPACTION_PREFIX = "The conversation history before this point was compacted into the following summary:\n\n<summary>\n"
COMPACTION_SUFFIX = "\n</summary>"
BRANCH_PREFIX = "The following is a summary of a branch that this conversation came back from:\n\n<summary>\n"
BRANCH_SUFFIX = "</summary>"


def looks_like(objs: list[dict]) -> bool:
    return bool(objs) and objs[0].get("type") == "session" and "id" in objs[0] and "cwd" in objs[0]


def format_version(header: dict) -> int | None:
    """The header's `version` (absent in the first format: version 1); None when it is not a number."""
    v = header.get("version", 1)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def read(path: Path) -> list[Transcript]:
    """The file's session, its turns held (as every reader gives them)."""
    return held(stream(path))


def stream(path: Path) -> Stream:
    """One model call per assistant entry, in file order; its history is the chain of `parentId`
    links back to the root, so a session pi branched (`/tree`, `/fork`) gives each call its own.
    A version-1 file (no entry ids: one linear chain, compactions pointing at a line index) is
    linked the way pi's own migration links it.

    Read in one pass, line by line: an entry's parents are before it, so each call's history is
    known when its entry is read. Entries are not held: where each lies and its parent are
    (`_Entries`), and the entries a call's history adds are read back from the file.

    pi sometimes appends an entry to a line that lost its newline (real files in pi-mono's history:
    `{…"stopReason":"stop"…}{"type":"message",…}`); pi's loader then drops both, but both were in the
    session pi had in memory and sent, so both are read (`JsonLines(glued=True)`)."""
    lines = JsonLines(path, glued=True)
    source = iter(lines)
    head = next(source, None)
    header = head[1] if head else {}
    version = format_version(header)
    if version not in SUPPORTED_VERSIONS:
        raise InvalidRequest(f"{path}: pi session format version {header.get('version')!r} is not supported "
                             f"(read: versions {', '.join(map(str, SUPPORTED_VERSIONS))})")
    t = Transcript(HARNESS, str(header.get("id") or path.stem), str(path), version=f"session format v{version}")
    t.note("system prompt not in the transcript")
    t.note("tool definitions not recorded")
    t.note("request parameters (max_tokens, stream_options) not recorded")
    entries = _Entries(path, linear=version == 1)
    if head is not None:
        entries.add(header, lines.start, lines.part)
    return Stream([t], _calls(t, lines, source, entries), lines)


def _calls(t: Transcript, lines: JsonLines, source, entries: "_Entries"):
    known: OrderedDict[str, list[dict]] = OrderedDict()  # entry id -> the messages up to and including it
    try:
        for _, obj in source:
            obj = entries.add(obj, lines.start, lines.part)
            msg = obj.get("message")
            if obj.get("type") != "message" or not isinstance(msg, dict) or msg.get("role") != "assistant":
                continue
            api = msg.get("api")
            if api != "openai-completions":
                t.note(f"calls over the {api!r} API rebuilt in chat-completions form")
            history, compacted = _history(t, obj, entries, known)
            # the message's own time is when the call started; the line's, when it was written after it
            turn = _turn(t, msg, parse_time(msg.get("timestamp")) or parse_time(obj.get("timestamp")), history, api)
            if (kept := t.kept(turn, compacted=compacted)) is not None:
                yield kept
    finally:
        entries.close()
    if lines.glued_lines:  # known at the end: the import stamps the final notes on every turn
        t.note(f"{lines.glued_lines} line(s) held two entries written without a newline between them: both read")


RECENT_ENTRIES = 16  # entries kept as read: those a call's history adds are usually the last few


class _Entries:
    """Where each entry lies (byte offset, and which value of a glued line) and its parent: all the
    reader holds of an entry. A version-1 file is linked as pi's `migrateV1ToV2` does: each entry's
    parent is the entry before it, and a compaction's `firstKeptEntryIndex` (an index into the
    file's entries, the header being 0) becomes `firstKeptEntryId`."""

    def __init__(self, path: Path, *, linear: bool):
        self.linear = linear
        self.where: dict[str, tuple[int, int, str | None]] = {}  # id -> (start, part, parent id)
        self.at = LinesAt(path, glued=True)
        self.count = 0  # entries read, the header included
        self.last: str | None = None  # version 1: the entry before
        # the last entries read: a call's history adds the entries since the previous call, just read
        self.recent: OrderedDict[str, dict] = OrderedDict()

    def add(self, obj: dict, start: int, part: int) -> dict:
        index, self.count = self.count, self.count + 1
        if obj.get("type") == "session":
            return obj
        if self.linear:
            self._link(obj, f"line-{index + 1}", self.last)
            self.last = obj["id"]
        if isinstance(obj.get("id"), str):
            self.where[obj["id"]] = (start, part, obj.get("parentId"))
            self.recent[obj["id"]] = obj
            if len(self.recent) > RECENT_ENTRIES:
                self.recent.popitem(last=False)
        return obj

    def _link(self, obj: dict, entry_id: str, parent: str | None) -> None:
        obj["id"], obj["parentId"] = entry_id, parent
        index = obj.get("firstKeptEntryIndex")
        if obj.get("type") == "compaction" and isinstance(index, int) and 0 < index < self.count:
            obj["firstKeptEntryId"] = f"line-{index + 1}"

    def __contains__(self, entry_id) -> bool:
        return entry_id in self.where

    def parent(self, entry_id: str) -> str | None:
        return self.where[entry_id][2]

    def get(self, entry_id: str) -> dict:
        if entry_id in self.recent:
            return self.recent[entry_id]
        start, part, parent = self.where[entry_id]
        obj = self.at.get(start, part)
        if self.linear:
            self._link(obj, entry_id, parent)
        return obj

    def close(self) -> None:
        self.at.close()


KNOWN_HISTORIES = 64  # histories kept by their last entry: the recent calls' (a branch further back reads again)


def _history(t: Transcript, obj: dict, entries: _Entries, known: OrderedDict) -> tuple[list[dict], bool]:
    """The messages on the chain of parents of `obj`, as pi's `buildSessionContext` makes them, and
    whether a compaction is on the part of the chain read. The walk stops at the first entry whose
    history is known (usually the previous call's), so a session costs linear time and every call's
    list shares the converted message objects."""
    chain: list[str] = []
    seen = {obj.get("id")}
    key = parent = obj.get("parentId")
    base: list[dict] = []
    while isinstance(parent, str):
        if parent in known:
            known.move_to_end(parent)
            base = known[parent]
            break
        if parent not in entries or parent in seen:
            t.note("the history before an entry is missing from the file (its parent is not there)")
            break
        seen.add(parent)
        chain.append(parent)
        parent = entries.parent(parent)
    history = list(base)
    compacted = False
    for entry_id in reversed(chain):
        entry = entries.get(entry_id)
        if entry.get("type") == "compaction":
            history = _compacted(t, entry, entries)
            compacted = True
            continue
        converted = _convert(t, entry)
        if converted is not None:
            history.append(converted)
    if isinstance(key, str):
        known[key] = history
        if len(known) > KNOWN_HISTORIES:
            known.popitem(last=False)
    return list(history), compacted


def _compacted(t: Transcript, entry: dict, entries: _Entries) -> list[dict]:
    """The history right after a compaction: its summary, then the entries it kept (from
    `firstKeptEntryId` up to the compaction), converted again."""
    t.note("compacted: pi's compaction summary replaced the earlier history (rebuilt as pi sends it)")
    summary = {"role": "user", "content": [{"type": "text", "text": COMPACTION_PREFIX + str(entry.get("summary", ""))
                                            + COMPACTION_SUFFIX}]}
    kept: list[str] = []
    first, parent, seen, found = entry.get("firstKeptEntryId"), entry.get("parentId"), set(), False
    while isinstance(parent, str) and parent not in seen and first is not None and parent in entries:
        seen.add(parent)
        kept.append(parent)
        if parent == first:
            found = True
            break
        parent = entries.parent(parent)
    if not found:  # the first kept entry is not on this chain: pi then sends the summary alone
        kept = []
    out = [summary]
    for entry_id in reversed(kept):
        e = entries.get(entry_id)
        if e.get("type") == "compaction":
            continue
        converted = _convert(t, e)
        if converted is not None:
            out.append(converted)
    return out


def _convert(t: Transcript, obj: dict) -> dict | None:
    kind = obj.get("type")
    if kind == "branch_summary" and obj.get("summary"):
        return {"role": "user", "content": [{"type": "text", "text": BRANCH_PREFIX + str(obj["summary"]) + BRANCH_SUFFIX}]}
    if kind == "custom_message":
        return _user({"content": obj.get("content")})
    msg = obj.get("message")
    if kind != "message" or not isinstance(msg, dict):
        return None
    role = msg.get("role")
    if role == "assistant":
        return _assistant(msg)
    if role in ("user", "custom", "hookMessage"):  # extensions' messages travel as user messages
        return _user(msg)
    if role == "bashExecution":  # a `!` command the user ran: sent as a user message
        if msg.get("excludeFromContext"):
            return None
        return {"role": "user", "content": [{"type": "text", "text": _bash_text(msg)}]}
    if role == "toolResult":
        parts = [p for p in msg.get("content") or [] if isinstance(p, dict)]
        text = "\n".join(p.get("text", "") for p in parts if p.get("type") == "text")
        if any(p.get("type") == "image" for p in parts):
            t.note("images in tool results not rebuilt")
        return {"role": "tool", "content": text or "(see attached image)", "tool_call_id": msg.get("toolCallId")}
    t.note(f"messages with role {role!r} not rebuilt")
    return None


def _bash_text(msg: dict) -> str:
    """pi's `bashExecutionToText`."""
    text = f"Ran `{msg.get('command')}`\n"
    text += f"```\n{msg['output']}\n```" if msg.get("output") else "(no output)"
    if msg.get("cancelled"):
        text += "\n\n(command cancelled)"
    elif msg.get("exitCode") not in (None, 0):
        text += f"\n\nCommand exited with code {msg.get('exitCode')}"
    if msg.get("truncated") and msg.get("fullOutputPath"):
        text += f"\n\n[Output truncated. Full output: {msg.get('fullOutputPath')}]"
    return text


def _user(msg: dict) -> dict | None:
    content = msg.get("content")
    if isinstance(content, str):
        return {"role": "user", "content": content}
    parts = []
    for item in content or []:
        if item.get("type") == "text":
            parts.append({"type": "text", "text": item.get("text", "")})
        elif item.get("type") == "image":
            parts.append({"type": "image_url", "image_url": {"url": f"data:{item.get('mimeType')};base64,{item.get('data')}"}})
    return {"role": "user", "content": parts} if parts else None


def _assistant(msg: dict) -> dict | None:
    blocks = [b for b in msg.get("content") or [] if isinstance(b, dict)]
    text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text" and b.get("text", "").strip())
    out: dict = {"role": "assistant", "content": text or None}
    calls = [b for b in blocks if b.get("type") == "toolCall"]
    if calls:
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c.get("name"),
                                           "arguments": json.dumps(c.get("arguments"), separators=(",", ":"),
                                                                   ensure_ascii=False)}} for c in calls]
    if out["content"] is None and not calls:
        return None  # pi skips an empty (aborted) reply
    return out


def _turn(t: Transcript, msg: dict, ts: float | None, history: list[dict], api: str | None):
    body = {"model": msg.get("model"), "messages": history}
    blocks = [b for b in msg.get("content") or [] if isinstance(b, dict)]
    usage = msg.get("usage") if isinstance(msg.get("usage"), dict) else None
    prompt = cached = completion = None
    if usage:
        fresh, read_ = int_or_none(usage.get("input")), int_or_none(usage.get("cacheRead"))
        prompt = None if fresh is None else fresh + (read_ or 0) + (int_or_none(usage.get("cacheWrite")) or 0)
        cached, completion = read_, int_or_none(usage.get("output"))
    if msg.get("stopReason") == "error":
        t.note("failed calls (stopReason error) rebuilt as requests without a reply")
    return make_turn(
        t, t.calls + 1, ts, ENDPOINT, body,
        text="".join(b.get("text", "") for b in blocks if b.get("type") == "text"),
        reasoning="".join(b.get("thinking", "") for b in blocks if b.get("type") == "thinking"),
        tool_calls=[openai_call(b.get("id"), b.get("name"), b.get("arguments", {})) for b in blocks
                    if b.get("type") == "toolCall"],
        finish_reason=STOP.get(msg.get("stopReason")), prompt_tokens=prompt, completion_tokens=completion,
        cached_tokens=cached, usage=usage)

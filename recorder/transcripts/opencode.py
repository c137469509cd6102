"""opencode: one SQLite database, `~/.local/share/opencode/opencode.db` ($XDG_DATA_HOME/opencode/).

opencode 1.18 keeps every session there (earlier versions wrote JSON files under `storage/`:
opencode_json.py reads those with the same rebuild). Tables read:
`session` (id, directory, title, parent_id for a sub-agent's session), `message` (one row per
message, `data` JSON: role, `time.created`, `tokens`, `finish`, `modelID`/`providerID`) and `part`
(one row per part of a message, `data` JSON: `text`, `reasoning`, `tool` with its call id, input and
output or error, `step-start`/`step-finish`, `file`, `compaction`…). Each assistant message is one
model call (one step; a message holding several steps is split at its `step-start` parts).

Rebuilt in the chat-completions form the `@ai-sdk/openai-compatible` provider sends: a user message
whose one part is text as a plain string, an assistant message's text joined (`""` when it only
calls tools) with `tool_calls` (arguments JSON-encoded), each tool result as a `role: "tool"`
message. What it does not hold: the system prompt (opencode composes it per call from its agent
prompt, environment and instruction files), the tool definitions, the request parameters, and the
title-generation side request (only its result, the session title, is kept). Other providers'
wire shapes (Anthropic, Responses) are not rebuilt: every call is written in this one form.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from prefixtrace.common.errors import InvalidRequest
from recorder.transcripts.common import (Stream, StreamPosition, Transcript, held, int_or_none, make_turn,
                                         openai_call, parse_time)
from recorder.turn import Turn

HARNESS = "opencode"
ENDPOINT = "/v1/chat/completions"
DB_NAME = "opencode.db"
SQLITE_MAGIC = b"SQLite format 3\x00"
FINISH = {"stop": "stop", "tool-calls": "tool_calls", "length": "length"}


def looks_like_file(p: Path) -> bool:
    """An SQLite file with opencode's session / message / part tables."""
    try:
        with open(p, "rb") as fh:
            if fh.read(16) != SQLITE_MAGIC:
                return False
    except OSError:
        return False
    try:
        con = _connect(p)
    except sqlite3.Error:
        return False
    try:
        names = {r[0] for r in con.execute("select name from sqlite_master where type = 'table'")}
        if not {"session", "message", "part"} <= names:
            return False
        cols = {r[1] for r in con.execute("pragma table_info(part)")}
        return {"message_id", "session_id", "data"} <= cols
    except sqlite3.Error:
        return False
    finally:
        con.close()


def find_storage(p: Path) -> Path | None:
    """opencode's database in `p` itself or in `p/opencode` (a data home)."""
    for candidate in (p / DB_NAME, p / "opencode" / DB_NAME):
        if candidate.is_file() and looks_like_file(candidate):
            return candidate
    return None


def looks_like_dir(p: Path) -> bool:
    return find_storage(p) is not None


def _connect(p: Path) -> sqlite3.Connection:
    # read-only: a running opencode may hold the database; nothing here writes to it
    return sqlite3.connect(f"file:{p.resolve()}?mode=ro", uri=True)


def read(p: Path) -> list[Transcript]:
    """The database's sessions, their turns held (as every reader gives them)."""
    return held(stream(p))


def stream(p: Path) -> Stream:
    """Each session's calls, message by message: a message's parts are read when it is (one indexed
    query each), and its call handed on, so neither the database nor a session is held, only the
    running history of the session being rebuilt."""
    db = p if p.is_file() else find_storage(p)
    if db is None:
        raise InvalidRequest(f"no {DB_NAME} under {p}")
    version = f"opencode.db ({_written_by(db)})"
    try:
        con = _connect(db)
        sessions = con.execute("select id, parent_id from session order by time_created, id").fetchall()
        total = con.execute("select count(*) from message").fetchone()[0]
    except sqlite3.Error as exc:
        raise InvalidRequest(f"cannot read opencode's database {db}: {exc}") from exc
    out = []
    for sid, parent in sessions:
        t = Transcript(HARNESS, sid, str(db), version=version)
        for note in SESSION_NOTES:
            t.note(note)
        if parent:
            t.note(f"a sub-agent session of {parent}")
        out.append(t)
    where = StreamPosition(db.stat().st_size)
    return Stream(out, _calls(db, con, out, total, where), where)


def _calls(db: Path, con: sqlite3.Connection, sessions: list[Transcript], total: int,
           where: StreamPosition) -> Iterator[Turn]:
    done = 0

    def parts_of(mid: str) -> list[dict]:
        return [_json(data) for (data,) in con.execute(
            "select data from part where message_id = ? order by time_created, id", [mid])]

    try:
        for t in sessions:
            history: list[dict] = []
            messages = con.execute("select id, time_created, data from message where session_id = ? "
                                   "order by time_created, id", [t.session_id])
            for mid, created, data in messages:
                done += 1
                where.position = where.size * done // max(total, 1)  # read by message, not by byte
                yield from rebuild_message(t, history, created, _json(data), parts_of(mid))
    except sqlite3.Error as exc:
        raise InvalidRequest(f"cannot read opencode's database {db}: {exc}") from exc
    finally:
        con.close()
    where.position = where.size


SESSION_NOTES = ("system prompt not in the transcript", "tool definitions not recorded",
                 "request parameters (max_tokens, tool_choice) not recorded",
                 "the title-generation side request is not in the transcript")


def _written_by(db: Path) -> str:
    """The opencode version the sessions name (`session.version`), else that the database says none."""
    try:
        con = _connect(db)
        try:
            cols = {r[1] for r in con.execute("pragma table_info(session)")}
            found = con.execute("select distinct version from session").fetchall() if "version" in cols else []
        finally:
            con.close()
    except sqlite3.Error:
        found = []
    versions = sorted(str(v) for (v,) in found if v)
    return "opencode " + ", ".join(versions) if versions else "version not written"


def _json(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _steps(parts: list[dict]) -> list[list[dict]]:
    """An assistant message's parts, one list per model call (split at `step-start`)."""
    steps: list[list[dict]] = []
    for part in parts:
        if part.get("type") == "step-start" or not steps:
            steps.append([])
        steps[-1].append(part)
    return steps


def rebuild_message(t: Transcript, history: list[dict], created, info: dict, parts: list[dict]) -> Iterator[Turn]:
    """One stored message appended to the session's running `history`; an assistant message's calls
    (one per step) handed on as they are rebuilt."""
    role = info.get("role")
    if role == "user":
        user = _user(t, parts)
        if user is not None:
            history.append(user)
        return
    if role != "assistant":
        return
    if info.get("summary") is True or any(p.get("type") == "compaction" for p in parts):
        t.note("compaction summaries rebuilt as they are stored; opencode's summary request is not")
    steps = _steps(parts)
    for i, step in enumerate(steps):
        ts = parse_time((info.get("time") or {}).get("created")) if i == 0 else \
            parse_time(next((p.get("time", {}).get("start") for p in step if isinstance(p.get("time"), dict)), None))
        turn = _turn(t, info, step, ts if ts is not None else parse_time(created), history, last=i == len(steps) - 1)
        history.extend(_assistant(t, step))
        if (kept := t.kept(turn)) is not None:
            yield kept


def _user(t: Transcript, parts: list[dict]) -> dict | None:
    texts = []
    for p in parts:
        if p.get("type") == "text" and not p.get("ignored"):
            texts.append({"type": "text", "text": p.get("text", "")})
        elif p.get("type") in ("file", "agent", "subtask"):
            t.note(f"user {p['type']} parts not rebuilt")
    if not texts:
        return None
    return {"role": "user", "content": texts[0]["text"] if len(texts) == 1 else texts}


def _assistant(t: Transcript, step: list[dict]) -> list[dict]:
    text = "".join(p.get("text", "") for p in step if p.get("type") == "text")
    if any(p.get("type") == "reasoning" and p.get("text") for p in step):
        t.note("reasoning parts not rebuilt")
    tools = [p for p in step if p.get("type") == "tool" and (p.get("state") or {}).get("status") in ("completed", "error")]
    if not text and not tools:
        return []
    msg: dict = {"role": "assistant", "content": text}
    if tools:
        msg["tool_calls"] = [{"id": p.get("callID"), "type": "function",
                              "function": {"name": p.get("tool"),
                                           "arguments": json.dumps(p["state"].get("input", {}), separators=(",", ":"),
                                                                   ensure_ascii=False)}} for p in tools]
    out = [msg]
    for p in tools:
        state = p["state"]
        if state.get("status") == "completed":
            content = state.get("output", "")
            if (state.get("time") or {}).get("compacted"):
                t.note("compacted tool outputs rebuilt from the stored output; opencode sends a placeholder")
        else:
            content = state.get("error", "")
            t.note("failed tool calls rebuilt with their stored error text")
        out.append({"role": "tool", "tool_call_id": p.get("callID"), "content": content})
    return out


def _turn(t: Transcript, info: dict, step: list[dict], ts: float | None, history: list[dict], last: bool) -> Turn:
    finish = next((p for p in step if p.get("type") == "step-finish"), {})
    tokens = finish.get("tokens") if isinstance(finish.get("tokens"), dict) else \
        info.get("tokens") if last and isinstance(info.get("tokens"), dict) else None
    prompt = cached = completion = None
    if tokens:
        cache = tokens.get("cache") if isinstance(tokens.get("cache"), dict) else {}
        fresh, read_ = int_or_none(tokens.get("input")), int_or_none(cache.get("read"))
        prompt = None if fresh is None else fresh + (read_ or 0) + (int_or_none(cache.get("write")) or 0)
        cached, completion = read_, int_or_none(tokens.get("output"))
    calls = [openai_call(p.get("callID"), p.get("tool"), (p.get("state") or {}).get("input", {}))
             for p in step if p.get("type") == "tool"]
    reason = finish.get("reason") or (info.get("finish") if last else None)
    body = {"model": info.get("modelID"), "messages": list(history)}
    return make_turn(t, t.calls + 1, ts, ENDPOINT, body,
                     text="".join(p.get("text", "") for p in step if p.get("type") == "text"),
                     reasoning="".join(p.get("text", "") for p in step if p.get("type") == "reasoning"),
                     tool_calls=calls, finish_reason=FINISH.get(reason), prompt_tokens=prompt,
                     completion_tokens=completion, cached_tokens=cached, usage=tokens)

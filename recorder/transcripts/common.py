"""What every transcript reader shares: the session it yields, and how one model call becomes a Turn.

A transcript is what a harness keeps of a conversation on disk, not what it sent: each reader
rebuilds the requests as far as the file allows and names what it could not rebuild (`notes`), so a
reader of the analysis never takes a guess for a recording. Every rebuilt turn says where it came
from: `upstream` is `transcript:<harness>` and `render["transcript"]` holds the harness, the file and
the session's notes (docs/FORMATS.md "Transcripts").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from recorder.transcripts.lines import JsonLines
from recorder.turn import Turn

UPSTREAM_PREFIX = "transcript:"


@dataclass
class Transcript:
    """One session of one harness, rebuilt from its file(s)."""

    harness: str  # "claude-code", "codex", "pi", "opencode"
    session_id: str
    source: str  # the file (or storage directory) it was read from
    turns: list[Turn] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what could not be rebuilt, once per session
    version: str = ""  # the format version read, as each reader names it ("session format v1", "2.0.46", …)
    calls: int = 0  # model calls the file holds (turns rebuilt plus those left out)
    compacted: set[int] = field(default_factory=set)  # turn numbers sent right after a compaction
    # request id -> what names the call across files (Claude Code: the reply's message id), where known
    call_keys: dict[str, str] = field(default_factory=dict)
    harness_version: str | None = None  # the harness's own version number, where its file records it
    # Read as a stream (turns handed on as they are rebuilt, not held): counts `finish` would take from `turns`.
    rebuilt: int = 0
    empty: int = 0
    _last_started: float | None = None

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def mark_compacted(self) -> None:
        """The next call this transcript emits is the first after a compaction (the harness replaced
        the history with a summary): the analyzer names its break `compaction` whatever else changed."""
        self.compacted.add(len(self.turns) + 1)

    @property
    def left_out(self) -> int:
        return self.calls - len(self.turns)

    def kept(self, turn: Turn, *, compacted: bool = False) -> Turn | None:
        """`finish` for one turn of a transcript read as a stream (recorder/transcripts/streamed.py): the
        turn counted and stamped (a new Turn, the one to hand on), or None when its history is not in the
        file. The notes stamped are those known so far; the import rewrites them once the file is read."""
        self.calls += 1
        if not _history_of(turn.request_body):
            self.empty += 1
            return None
        self.rebuilt += 1
        started = turn.started_at
        if self._last_started is not None and started <= self._last_started:
            started = self._last_started + 1e-6
        self._last_started = started
        return replace(turn, started_at=started, render={"transcript": self.origin(compacted)})

    def stamp_notes(self) -> None:
        """The session's notes, known once its file is read, on every turn held."""
        self.turns = [replace(turn, render={"transcript": {**turn.render["transcript"],
                                                           "not_rebuilt": list(self.notes)}})
                      for turn in self.turns]

    def end_stream(self) -> None:
        """The note a streamed read can only write at its end: how many calls were left out."""
        if self.empty:
            self.note(f"{self.empty} call(s) left out: their history (the messages sent) is not in the file")

    def origin(self, compacted: bool = False) -> dict:
        """What a turn's `render["transcript"]` says of where it came from."""
        origin = {"harness": self.harness, "file": Path(self.source).name, "session": self.session_id,
                  "version": self.version, "not_rebuilt": list(self.notes)}
        if self.harness_version:
            origin["harness_version"] = self.harness_version
        if compacted:
            origin["compacted"] = True
        return origin

    @property
    def rebuilt_count(self) -> int:
        """Calls rebuilt: the turns held, or, read as a stream, those already handed on."""
        return max(self.rebuilt, len(self.turns))

    def finish(self) -> "Transcript":
        """Leaves out the calls whose history is not in the file (an empty request says nothing of what
        was sent: analysing it would report a break that never happened), keeps the file's order in the
        turns' times, and stamps every turn with the session's notes (known only once the whole file is
        read)."""
        kept, empty, compacted = [], 0, set()
        for n, turn in enumerate(self.turns, start=1):
            if _history_of(turn.request_body):
                kept.append(turn)
                if n in self.compacted:
                    compacted.add(len(kept))
            else:
                empty += 1
        self.calls += len(self.turns)
        if empty:
            self.note(f"{empty} call(s) left out: their history (the messages sent) is not in the file")
        self.compacted = compacted
        self.turns = [replace(turn, started_at=started, render={"transcript": self.origin(n in compacted)})
                      for n, (turn, started) in enumerate(zip(kept, _in_file_order(kept)), start=1)]
        return self


@dataclass
class StreamPosition:
    """How far a reader that reads in more than one pass has got, for a progress line: the byte
    offset of the call it is rebuilding."""

    size: int
    position: int = 0
    lineno: int | None = None  # not known: the stop message names the bytes read only


@dataclass
class Stream:
    """A session file read as a stream: its sessions (complete once the first turn is handed on, or
    the turns are spent),
    their rebuilt turns as they are rebuilt (each stamped by `Transcript.kept`), and how far the
    reading has got (a `JsonLines` or a `StreamPosition`: `position`, `size`, `lineno`). The
    sessions' notes are complete once the turns are spent."""

    sessions: list[Transcript]
    turns: Iterator[Turn]
    where: Any


def held(stream: Stream) -> list[Transcript]:
    """A stream's sessions with their turns held, as a whole-file read gives them: the notes written
    after a turn was rebuilt travel on every turn of its session. Sessions without a model call are
    left out."""
    by_id: dict[str, Transcript] = {}
    for turn in stream.turns:
        if turn.session_id not in by_id:  # a reader may list its sessions once its first pass is done
            by_id = {t.session_id: t for t in stream.sessions}
        by_id[turn.session_id].turns.append(turn)
    for t in stream.sessions:
        t.end_stream()
        t.stamp_notes()
        t.compacted.update(n for n, turn in enumerate(t.turns, start=1) if turn.render["transcript"].get("compacted"))
    return [t for t in stream.sessions if t.calls]  # one whose calls were all left out still says so


def _history_of(body: dict) -> list:
    value = body.get("messages", body.get("input")) if isinstance(body, dict) else None
    return value if isinstance(value, list) else []


def _in_file_order(turns: list[Turn]) -> list[float]:
    """The turns' start times, in the file's order. Turns are ordered by time downstream; a file's times
    are not monotonic (a resumed Claude Code session rewrites many lines to one timestamp, pi's entry and
    message clocks differ), and the file's order is the call order. A time that goes backwards is raised
    to just after the previous one."""
    times: list[float] = []
    for turn in turns:
        started = turn.started_at
        if times and started <= times[-1]:
            started = times[-1] + 1e-6
        times.append(started)
    return times


def parse_time(value: Any) -> float | None:
    """ISO-8601 (`…Z`) or epoch seconds/milliseconds, as harnesses write times; None when absent."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value / 1000.0 if value > 1e11 else float(value)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return moment.timestamp()
    return None


def read_jsonl_lines(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) of every JSON-object line, read line by line (recorder/transcripts/lines.py);
    a line that does not parse raises InvalidRequest naming it (a half-written last line of a live
    session included)."""
    return list(JsonLines(path))


def openai_call(call_id: str | None, name: str | None, arguments: Any) -> dict:
    """A tool call in the shape the recorder stores for every API (the OpenAI one)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def make_turn(t: Transcript, n: int, ts: float | None, endpoint: str, body: dict, *, text: str = "",
              reasoning: str = "", tool_calls: list[dict] | None = None, finish_reason: str | None = None,
              prompt_tokens: int | None = None, completion_tokens: int | None = None,
              cached_tokens: int | None = None, usage: dict | None = None) -> Turn:
    """Model call number `n` of the session as a Turn. The id is derived from the session, its file's
    name and `n`, so importing the same transcript again (or a longer copy of a live session) replaces,
    never duplicates, and a session id found in two files (Claude Code writes a resumed session's id
    into the new file) never overwrites the other file's calls; `ts` falls back to keeping file order."""
    digest = hashlib.sha256(f"{t.harness}\0{t.session_id}\0{Path(t.source).name}".encode()).hexdigest()[:12]
    return Turn(
        request_id=f"transcript-{t.harness}-{digest}-{n:04d}",
        started_at=ts if ts is not None else float(n),
        endpoint=endpoint,
        upstream=UPSTREAM_PREFIX + t.harness,
        request_body=body,
        session_id=t.session_id,
        stream=bool(body.get("stream", False)),
        status=200,
        response_text=text,
        reasoning_text=reasoning,
        tool_calls=tool_calls or None,
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        usage=usage,
    )


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None

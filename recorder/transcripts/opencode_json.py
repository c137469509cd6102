"""opencode before its SQLite database: JSON files under `~/.local/share/opencode/storage/`.

What it holds: `session/<project id>/<session id>.json` (the session's info: `id`, `parentID`,
`time.created`; opencode 0.x kept them in `session/info/`), `message/<session id>/<message
id>.json` (a message's info, as the database's `message.data` holds it plus `id` and `sessionID`)
and `part/<message id>/<part id>.json` (one part, as `part.data` plus its ids). Some 0.x versions
kept a message's parts inside its file (`parts`): read too. The calls are rebuilt by the same code
as the database's (`opencode.py`), so both forms give the same requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from prefixtrace.common.errors import InvalidRequest
from recorder.transcripts import opencode
from recorder.transcripts.common import Stream, StreamPosition, Transcript, held
from recorder.turn import Turn

VERSION = "JSON storage (opencode before opencode.db)"


def _version(info: dict) -> str:
    """The format and, where the session names it (opencode 1.x writes `version`), the writer."""
    written_by = info.get("version")
    return f"JSON storage (opencode {written_by})" if isinstance(written_by, str) and written_by else VERSION


def find_storage(p: Path) -> Path | None:
    """`p` itself or the first `storage` directory below it holding `session/` and `message/`."""
    for d in (p, *sorted(p.rglob("storage"))):
        if d.is_dir() and (d / "session").is_dir() and (d / "message").is_dir():
            return d
    return None


def _load(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(f"cannot read opencode's {path}: {exc}") from exc
    return value if isinstance(value, dict) else {}


def _created(info: dict) -> float:
    created = (info.get("time") or {}).get("created") if isinstance(info.get("time"), dict) else None
    return created if isinstance(created, (int, float)) else 0


def read(storage: Path) -> list[Transcript]:
    """The storage's sessions, their turns held (as every reader gives them)."""
    return held(stream(storage))


def stream(storage: Path) -> Stream:
    """Each session's calls, message by message: a session's message infos are read to order them
    (by creation), each message's parts when it is rebuilt."""
    sessions = [_load(f) for f in sorted((storage / "session").rglob("*.json"))]
    sessions = sorted((s for s in sessions if isinstance(s.get("id"), str)), key=lambda s: (_created(s), s["id"]))
    out = []
    for info in sessions:
        t = Transcript(opencode.HARNESS, info["id"], str(storage), version=_version(info))
        for note in opencode.SESSION_NOTES:
            t.note(note)
        if info.get("parentID"):
            t.note(f"a sub-agent session of {info['parentID']}")
        out.append(t)
    where = StreamPosition(len(out))
    return Stream(out, _calls(storage, out, where), where)


def _calls(storage: Path, sessions: list[Transcript], where: StreamPosition) -> Iterator[Turn]:
    for n, t in enumerate(sessions):
        where.position = n  # read by session, not by byte
        messages = [_load(f) for f in sorted((storage / "message" / t.session_id).glob("*.json"))]
        messages = sorted((m for m in messages if isinstance(m.get("id"), str)), key=lambda m: (_created(m), m["id"]))
        history: list[dict] = []
        for m in messages:
            parts = m.get("parts") if isinstance(m.get("parts"), list) else \
                [_load(f) for f in sorted((storage / "part" / m["id"]).glob("*.json"))]
            parts = sorted((p for p in parts if isinstance(p, dict)), key=lambda p: str(p.get("id", "")))
            yield from opencode.rebuild_message(t, history, _created(m), m, parts)
    where.position = where.size

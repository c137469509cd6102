"""Per-session prefix-stability reports, their text/JSON forms, and `check`.

`analyze` walks each session in time order and compares every request with
the previous renderable one. Token counts in `common_tokens` come from the
analysis tokenizer (named in the report); `prompt_tokens`/`cached_tokens` are
what the server reported, so `reprefill_tokens` mixes the two and is an
estimate.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from analyzer.divergence import Divergence, compare_rendered
from analyzer.sessions import group_sessions
from analyzer.tokens import Tokenizer, as_tokenizer
from prefixtrace.errors import InvalidRequest
from recorder.jsonl import read_jsonl
from recorder.reader import iter_turns
from recorder.turn import Turn

Source = str | Path | Iterable[Turn]
SQLITE_MAGIC = b"SQLite format 3\x00"


@dataclass
class TurnReport:
    index: int
    request_id: str
    started_at: float
    status: int
    prompt_tokens: int | None  # as reported by the server
    cached_tokens: int | None  # as reported; None = the server did not say
    rendered_tokens: int | None  # analysis tokenizer, whole rendering
    common_tokens: int | None  # shared with the previous turn (analysis tokenizer)
    common_chars: int | None
    reprefill_tokens: int | None  # prompt tokens - common tokens, an estimate
    divergence: Divergence | None = None  # None for the first turn or an unrenderable one
    note: str = ""  # "first", "unrenderable", or ""

    @property
    def where(self) -> str:
        if self.note:
            return f"({self.note})"
        return self.divergence.describe() if self.divergence else "?"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["divergence"] = self.divergence.to_dict() if self.divergence else None
        return d


@dataclass
class SessionReport:
    session_id: str
    inferred: bool
    tokenizer: str
    turns: list[TurnReport] = field(default_factory=list)

    @property
    def diverged(self) -> list[TurnReport]:
        return [t for t in self.turns if t.divergence and not t.divergence.append_only]

    @property
    def append_only(self) -> bool:
        return not self.diverged

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "inferred": self.inferred,
            "tokenizer": self.tokenizer,
            "append_only": self.append_only,
            "num_turns": len(self.turns),
            "num_diverged": len(self.diverged),
            "turns": [t.to_dict() for t in self.turns],
        }


def load_turns(source: Source) -> list[Turn]:
    """Turns from a recorder database, a JSONL file (sniffed by content, not
    extension) or an iterable of Turns, sorted by start time."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        try:
            with open(path, "rb") as fh:
                magic = fh.read(len(SQLITE_MAGIC))
        except OSError as exc:
            raise InvalidRequest(f"cannot read {path}: {exc}") from exc
        turns = list(iter_turns(path)) if magic == SQLITE_MAGIC else read_jsonl(path)
    else:
        turns = list(source)
    return sorted(turns, key=lambda t: t.started_at)


def analyze(
    source: Source,
    *,
    tokenizer: Tokenizer | Callable[[str], list[int]] | str | None = None,
    session: str | None = None,
) -> list[SessionReport]:
    """One report per session (explicit or inferred), in order of first turn.

    Args:
        source: database path, JSONL path, or Turns.
        tokenizer: Tokenizer, callable, spec for `load_tokenizer`, or None
            for the default (tiktoken o200k_base, else a regex fallback).
        session: only the session with this id (explicit or "inferred-N").
    """
    tok = as_tokenizer(tokenizer)
    reports = []
    for sess in group_sessions(load_turns(source)):
        if session is not None and sess.id != session:
            continue
        report = SessionReport(sess.id, sess.inferred, tok.name)
        prev = prev_ids = None
        for index, (turn, rendered) in enumerate(zip(sess.turns, sess.rendered)):
            row = TurnReport(
                index, turn.request_id, turn.started_at, turn.status,
                turn.prompt_tokens, turn.cached_tokens, None, None, None, None,
            )  # fmt: skip
            report.turns.append(row)
            if rendered is None:
                row.note = "unrenderable"
                continue
            ids = tok(rendered.text)
            row.rendered_tokens = len(ids)
            prompt = turn.prompt_tokens if turn.prompt_tokens is not None else len(ids)
            if prev is None:
                row.note, row.common_tokens, row.common_chars = "first", 0, 0
                row.reprefill_tokens = prompt
            else:
                div = compare_rendered(prev, rendered, tok, prev_ids=prev_ids, next_ids=ids)
                row.divergence = div
                row.common_tokens, row.common_chars = div.common_tokens, div.common_chars
                row.reprefill_tokens = max(0, prompt - div.common_tokens)
            prev, prev_ids = rendered, ids
        reports.append(report)
    if session is not None and not reports:
        raise InvalidRequest(f"no session {session!r}")
    return reports


def _q(value: Any) -> str:
    return "?" if value is None else str(value)


def format_text(reports: list[SessionReport]) -> str:
    """A readable table per session, with before/after excerpts under each
    divergence."""
    out = []
    for rep in reports:
        kind = "inferred" if rep.inferred else "explicit"
        verdict = "append-only" if rep.append_only else f"{len(rep.diverged)} divergence(s)"
        out.append(f"session {rep.session_id} ({kind}): {len(rep.turns)} turns, {verdict}  [tokenizer: {rep.tokenizer}]")
        out.append(f"  {'#':>3}  {'request_id':<24} {'prompt':>7} {'cached':>7} {'common tok/chars':>18}  {'reprefill':>9}  divergence")
        for t in rep.turns:
            common = f"{_q(t.common_tokens)}/{_q(t.common_chars)}"
            out.append(
                f"  {t.index:>3}  {t.request_id[:24]:<24} {_q(t.prompt_tokens):>7} {_q(t.cached_tokens):>7}"
                f" {common:>18}  {_q(t.reprefill_tokens):>9}  {t.where}"
            )
            d = t.divergence
            if d and not d.append_only:
                out.append(f"{'':>8}before: {d.before!r}")
                out.append(f"{'':>8}prev:   {d.prev_after!r}")
                out.append(f"{'':>8}next:   {d.next_after!r}")
        out.append("")
    return "\n".join(out)


def to_json(reports: list[SessionReport]) -> str:
    return json.dumps([r.to_dict() for r in reports], indent=2, ensure_ascii=False)


@dataclass(frozen=True)
class Problem:
    """One non-append-only pair found by `check`."""

    session_id: str
    index: int  # of the later turn in the session
    request_id: str
    prev_request_id: str
    divergence: Divergence

    def __str__(self) -> str:
        d = self.divergence
        return (
            f"session {self.session_id} turn {self.index} ({self.request_id}) does not extend "
            f"{self.prev_request_id}: diverged at {d.describe()} (char {d.offset}); "
            f"prev {d.prev_after!r} vs next {d.next_after!r}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "index": self.index,
            "request_id": self.request_id,
            "prev_request_id": self.prev_request_id,
            "divergence": self.divergence.to_dict(),
        }


def check(
    source: Source, *, tokenizer: Tokenizer | Callable[[str], list[int]] | str | None = None
) -> tuple[bool, list[Problem]]:
    """The CI check: every consecutive pair in every session is append-only.

    Returns (ok, problems). Unrenderable turns are skipped (not failures).
    Token counts are irrelevant here, so the cheap regex tokenizer is the
    default.
    """
    reports = analyze(source, tokenizer=tokenizer or "regex")
    problems = []
    for rep in reports:
        prev_id = None
        for t in rep.turns:
            if t.divergence and not t.divergence.append_only:
                problems.append(Problem(rep.session_id, t.index, t.request_id, prev_id or "?", t.divergence))
            if t.note != "unrenderable":
                prev_id = t.request_id
    return not problems, problems

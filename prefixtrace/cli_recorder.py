"""`export`, `import`, `replay` and `db info`: thin shells over `recorder`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from common.words import plural
from prefixtrace.cli_common import (JSON_OPTION, FiniteFloatRange, echo, echo_json, library_errors, output_path,
                                    progress, write_or_echo)

DB = click.argument("db", type=click.Path(exists=True, dir_okay=False, path_type=Path))


@click.command()
@DB
@click.option("--format", "fmt", type=click.Choice(["jsonl", "har"]), default="jsonl", show_default=True)
@click.option("--session", help="Only this session: a recorded session id, or an inferred name as `analyze` prints "
                                 "it (inferred-2).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), callback=output_path,
              help="Output file (default: stdout).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the summary as a JSON object: on stdout with --out, else on stderr after the data.")
@library_errors
def export(db, fmt, session, out, as_json):
    """Export recorded turns as JSONL (one wrapped record per line) or HAR 1.2.

    Request bodies are written byte for byte as they were stored; see
    docs/FORMATS.md. A file given with --out appears only once complete.

    Example: prefixtrace export prefixtrace.db --format har --session s1 --out s1.har
    """
    from recorder.sources import export as run_export

    request_ids = None if session is None else _inferred_session_requests(db, session)
    count = run_export(db, out if out else sys.stdout, fmt, session=None if request_ids is not None else session,
                       request_ids=request_ids)
    if as_json:
        summary = {"exported": count, "db": str(db), "format": fmt, "session": session, "out": str(out) if out else None}
        click.echo(json.dumps(summary), err=out is None)
    else:
        click.echo(f"exported {plural(count, 'turn')}", err=True)


def _inferred_session_requests(db: Path, session: str) -> list[str] | None:
    """None when `session` is a stored id; else the request ids of the session the analyzer
    names so (`inferred-2`: turns recorded without an id, grouped by shared prefixes).
    A name that is neither is an error listing what there is, not an empty export."""
    from recorder.reader import session_ids

    stored = session_ids(db)
    if session in stored:
        return None
    from analyzer.analysis import analyze

    # Grouping reads payloads only; a cheap tokenizer keeps this from rendering with the real one.
    report = analyze(db, tokenizer="regex")
    for found in report.sessions:
        if found.inferred and found.id == session:
            return [t.request_id for t in found.turns]
    inferred = [s.id for s in report.sessions if s.inferred]
    names = ", ".join([*stored[:10], *inferred[:10]]) or "none"
    raise click.ClickException(f"no session {session!r} in {db}; sessions there: {names}"
                               f"{' …' if len(stored) > 10 or len(inferred) > 10 else ''}")


@click.command(name="import")
@click.argument("file", metavar="FILE_OR_DIR", type=click.Path(exists=True, path_type=Path))
@click.option("--db", default="prefixtrace.db", show_default=True, type=click.Path(dir_okay=False, path_type=Path))
@JSON_OPTION
@library_errors
def import_(file, db, as_json):
    """Import a JSONL file (wrapped records or bare request bodies), a HAR
    file (from prefixtrace, a browser or mitmproxy), or a harness's session
    transcripts into a database.

    Transcripts: a Claude Code, Codex or pi session file, opencode's database
    (opencode.db), or a directory holding any of them (~/.claude/projects,
    ~/.codex/sessions, ~/.pi/agent/sessions, ~/.local/share/opencode). Each
    model call becomes a turn rebuilt as the harness sent it, as far as the
    file holds it; what it does not hold is printed per session and kept on
    the turns (docs/FORMATS.md "Transcripts").

    All or nothing: a malformed line or entry is reported with its number and
    nothing is written.

    Example: prefixtrace import ~/.claude/projects --db prefixtrace.db
    """
    from recorder.sources import import_path

    with progress(f"importing {file.name}"):
        count, transcripts = import_path(file, db)
    if as_json:
        summary = {"imported": count, "file": str(file), "db": str(db)}
        if transcripts:  # what each rebuilt session lacks (JSONL and HAR imports print as before)
            summary["sessions"] = [{"harness": t.harness, "session": t.session_id, "source": t.source,
                                    "turns": len(t.turns), "not_rebuilt": t.notes} for t in transcripts]
        echo_json(summary)
        return
    for t in transcripts:
        click.echo(f"{t.harness} session {t.session_id}: {plural(len(t.turns), 'turn')} rebuilt from {t.source}")
        for note in t.notes:
            click.echo(f"  not rebuilt: {note}")
    click.echo(f"imported {plural(count, 'turn')} into {db}")


@click.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--target", "targets", required=True, multiple=True, metavar="URL",
              help="OpenAI-compatible server to replay against; repeat for an A/B comparison (the first is the baseline).")
@click.option("--session", help="Only this session.")
@click.option("--concurrency", default=1, show_default=True, type=click.IntRange(min=1),
              help="Sessions replayed in parallel.")
@click.option("--pace", type=click.Choice(["original", "asap"]), default="asap", show_default=True,
              help="original: keep the recorded gaps between requests; asap: send each as soon as the last finished.")
@click.option("--max-gap", type=FiniteFloatRange(min=0), metavar="SECONDS", help="With --pace original, cap each gap at this.")
@click.option("--model", help="Send this model name instead of the recorded one.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), callback=output_path,
              help="Write the report here: JSON, or a self-contained HTML page when the name ends in .html.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole report as JSON instead of the table.")
@library_errors
def replay(src, targets, session, concurrency, pace, max_gap, model, out, as_json):
    """Re-send recorded requests (database, JSONL or HAR), in order per
    session, to one or more servers, and measure each turn.

    Reports per turn and target: status, prompt tokens, cached tokens as the
    target reports them (normalised across OpenAI, llama.cpp and Anthropic
    usage; ? when not reported), the recorded cached tokens, TTFT and total
    time; then medians and ratios to the first target. An unreachable target
    is named and skipped; the others still run, and the exit status is 1.

    Example: prefixtrace replay prefixtrace.db --target http://127.0.0.1:8080 --target http://127.0.0.1:8081 --out ab.html
    """
    from recorder.replay import replay as run_replay, write_report
    from recorder.replay_report import format_replay
    from recorder.sources import load_turns

    turns = load_turns(src, session=session)
    total = sum(1 for t in turns if isinstance(t.request_body, dict) and isinstance(t.request_body.get("messages"), list))
    with progress("replaying", total=total * len(targets)) as advance:
        report = run_replay(turns, list(targets), concurrency=concurrency, pace=pace, model=model,
                            max_gap_s=max_gap, progress=lambda url, turn: advance(1))
    echo(json.dumps(report, indent=2) if as_json else format_replay(report))
    if out:
        write_report(report, out)
        click.echo(f"wrote {out}", err=True)
    failed = [t for t in report["targets"] if t.get("error")]
    for target in failed:
        echo(f"Error: {target['error']}", err=True)
    if failed:
        sys.exit(1)


@click.group()
def db():
    """Inspect a recorder database.

    Example: prefixtrace db info prefixtrace.db
    """


@db.command()
@DB
@JSON_OPTION
@library_errors
def info(db, as_json):
    """Sessions, turns, size, date range and message store of a recorder database.

    Prints JSON either way; --json is accepted so scripts can pass it to every command.

    Example: prefixtrace db info prefixtrace.db --json
    """
    from recorder import db_info

    write_or_echo(json.dumps(db_info(db), indent=2), None)


COMMANDS = [export, import_, replay, db]

"""`export`, `import`, `replay` and `db info`: thin shells over `recorder`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from prefixtrace.common.escaping import visible
from prefixtrace.common.words import plural
from prefixtrace.cli_common import (JSON_OPTION, FiniteFloatRange, echo, echo_json, library_errors, output_path,
                                    progress, write_or_echo)

DB = click.argument("db", type=click.Path(exists=True, dir_okay=False, path_type=Path))


@click.command()
@DB
@click.option("--format", "fmt", type=click.Choice(["jsonl", "har", "mooncake", "agentic-mooncake", "weka"]),
              default="jsonl", show_default=True,
              help="mooncake, agentic-mooncake (Dynamo's, with parent/wait links), weka: block-hash traces for "
                   "replay tools (no text).")
@click.option("--session", help="Only this session: a recorded session id, or an inferred name as `analyze` prints "
                                 "it (inferred-2).")
@click.option("--block-size", type=click.IntRange(min=1), default=512, show_default=True,
              help="mooncake, agentic-mooncake, weka: tokens per hashed block.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), callback=output_path,
              help="Output file (default: stdout).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the summary as a JSON object: on stdout with --out, else on stderr after the data.")
@library_errors
def export(db, fmt, session, block_size, out, as_json):
    """Export recorded turns as JSONL (one wrapped record per line) or HAR 1.2, or
    as block-hash traces for replay tools (mooncake, agentic-mooncake, weka:
    lengths and one id per block of prompt tokens, no text; agentic-mooncake,
    Dynamo's, also each request's parent and wait; docs/FORMATS.md
    "Block-hash traces").

    Request bodies are written byte for byte as they were stored; see
    docs/FORMATS.md. A file given with --out appears only once complete.

    Example: prefixtrace export prefixtrace.db --format har --session s1 --out s1.har
    """
    from recorder.sources import export as run_export

    if fmt in ("mooncake", "agentic-mooncake", "weka"):
        _export_trace(db, fmt, session, block_size, out, as_json)
        return

    request_ids = None if session is None else _inferred_session_requests(db, session)
    count = run_export(db, out if out else sys.stdout, fmt, session=None if request_ids is not None else session,
                       request_ids=request_ids)
    if as_json:
        summary = {"exported": count, "db": str(db), "format": fmt, "session": session, "out": str(out) if out else None}
        click.echo(json.dumps(summary), err=out is None)
    else:
        click.echo(f"exported {plural(count, 'turn')}", err=True)


def _export_trace(db: Path, fmt: str, session: str | None, block_size: int, out: Path | None, as_json: bool) -> None:
    """A block-hash trace of `db` (analyzer/block_traces.py), written whole or not at all."""
    import io

    from analyzer.block_traces import export_trace

    if session is not None:
        raise click.UsageError(f"--session is not supported with --format {fmt}")
    buf = io.StringIO()
    count = export_trace(db, buf, fmt, block_size=block_size)
    write_or_echo(buf.getvalue().rstrip("\n"), out)
    summary = {"exported": count, "db": str(db), "format": fmt, "block_size": block_size,
               "out": str(out) if out else None}
    click.echo(json.dumps(summary) if as_json else f"exported {count} request(s)", err=out is None or not as_json)


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

    Each session says the format version read and how many of its calls were
    rebuilt; a call whose history is not in the file is left out, and a file
    that rebuilt fewer than half its calls makes import exit 1 (after storing
    what it rebuilt). A directory's other files are listed as skipped, with
    why. A JSONL or HAR file, or a directory, is all or nothing: a malformed
    line or entry is reported with its number and nothing of it is written.

    One session file is read as a stream and written in batches: memory stays
    bounded however large the file (a Codex rollout of GBs), a progress line
    shows on a terminal, and a bad line, Ctrl-C or SIGTERM stops it keeping
    what it wrote, saying where; importing the same file again redoes it
    without duplicating a turn (docs/FORMATS.md "Streamed import").

    Example: prefixtrace import ~/.claude/projects --db prefixtrace.db
    """
    from prefixtrace.cli_import_progress import import_progress, sigterm_as_interrupt
    from recorder.sources import import_path
    from recorder.transcripts.streamed import ImportStopped

    try:
        with sigterm_as_interrupt(), import_progress(file.name) as on_progress:
            count, transcripts = import_path(file, db, on_progress=on_progress)
    except ImportStopped as exc:
        if not exc.interrupted:
            raise
        click.echo(f"Error: {visible(exc.message)}", err=True)
        raise SystemExit(130) from exc  # as a shell reports a command stopped by a signal
    skipped = getattr(transcripts, "skipped", [])
    poor = transcripts.poorly_rebuilt() if transcripts else []
    if as_json:
        summary = {"imported": count, "file": str(file), "db": str(db)}
        if transcripts:  # what each rebuilt session lacks (JSONL and HAR imports print as before)
            summary["sessions"] = [{"harness": t.harness, "version": t.version, "session": t.session_id,
                                    "source": t.source, "calls": t.calls, "turns": t.rebuilt_count,
                                    "not_rebuilt": t.notes} for t in transcripts]
            summary["skipped"] = [{"file": f, "why": why} for f, why in skipped]
        echo_json(summary)
    else:
        for t in transcripts:
            echo(one_line(f"{t.harness} session {t.session_id} ({t.version or 'version not written'}): "
                          f"{t.rebuilt_count} of {t.calls} call(s) rebuilt from {t.source}"))
            for note in t.notes:
                echo(one_line(f"  not rebuilt: {note}"))
        for f, why in skipped:
            echo(one_line(f"skipped {f}: {why}"))
        click.echo(f"imported {plural(count, 'turn')} into {db}")
    if poor:
        raise click.ClickException("; ".join(visible(one_line(
            f"{t.source} ({t.harness} {t.version}) rebuilt {t.rebuilt_count} of its {t.calls} call(s): fewer than half, "
            "so an analysis of it would answer for calls it does not have")) for t in poor))


def one_line(text: str) -> str:
    """Client text (session ids, file names) kept on its line: a newline in it cannot forge another."""
    return text.replace("\n", "\\n")


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
@click.option("--fix", "fixes", metavar="NAME[,NAME...]", multiple=True,
              help="Prove these fixes: each session is sent as recorded and as fixed to the one --target, "
                   "alternating, and the two are compared (docs/FIXES.md \"Paired replay\").")
@click.option("--min-gain", default=0.05, show_default=True, type=FiniteFloatRange(min=-1, max=1), metavar="SHARE",
              help="With --fix: the hit-rate gain (0.05 = 5 points) the fixed variant must reach to pass.")
@click.option("--price-model", metavar="MODEL", help="With --fix: price both variants' prompts as this model.")
@library_errors
def replay(src, targets, session, concurrency, pace, max_gap, model, out, as_json, fixes, min_gain, price_model):
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
    if fixes:
        return _paired_replay(turns, targets, fixes, min_gain, model, price_model, out, as_json)
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


def _paired_replay(turns, targets, fixes, min_gain, model, price_model, out, as_json) -> None:
    from analyzer.fixes import parse_fix_names
    from prefixtrace.fix_replay import format_paired, paired_replay, write_paired

    names = parse_fix_names(list(fixes))
    if len(targets) != 1:
        raise click.UsageError("--fix replays each session twice against one server: give one --target")
    total = sum(1 for t in turns if isinstance(t.request_body, dict))
    with progress("replaying as recorded and as fixed", total=2 * total) as advance:
        report = paired_replay(turns, targets[0], names, min_gain=min_gain, model=model, price_model=price_model,
                               progress=lambda: advance(1))
    echo(json.dumps(report, indent=2) if as_json else format_paired(report))
    if out:
        write_paired(report, out)
        click.echo(f"wrote {out}", err=True)


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

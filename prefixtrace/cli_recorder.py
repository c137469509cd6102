"""`export`, `import`, `replay` and `db info`: thin shells over `recorder`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from prefixtrace.cli_common import library_errors, write_or_echo

DB = click.argument("db", type=click.Path(exists=True, dir_okay=False, path_type=Path))


@click.command()
@DB
@click.option("--format", "fmt", type=click.Choice(["jsonl"]), default="jsonl", show_default=True)
@click.option("--session", help="Only this session.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Output file (default: stdout).")
@library_errors
def export(db, fmt, session, out):
    """Export recorded turns as JSONL, one wrapped record per line (docs/FORMATS.md).

    Example: prefixtrace export prefixtrace.db --session s1 --out s1.jsonl
    """
    import sys

    from recorder import export_jsonl

    count = export_jsonl(db, out if out else sys.stdout, session=session)
    click.echo(f"exported {count} turn(s)", err=True)


@click.command(name="import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--db", default="prefixtrace.db", show_default=True, type=click.Path(dir_okay=False, path_type=Path))
@library_errors
def import_(file, db):
    """Import a JSONL file (wrapped records or bare request bodies) into a database.

    All or nothing: a malformed line is reported with its number and nothing is written.

    Example: prefixtrace import traffic.jsonl --db prefixtrace.db
    """
    from recorder import import_jsonl

    count = import_jsonl(file, db)
    click.echo(f"imported {count} turn(s) into {db}")


@click.command()
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--target", required=True, metavar="URL", help="OpenAI-compatible server to replay against.")
@click.option("--session", help="Only this session.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the JSON report here.")
@library_errors
def replay(src, target, session, out):
    """Re-send recorded requests, in order per session, and measure each turn.

    Reports per turn: status, prompt tokens, cached tokens as the target
    reports them (? when it does not), the recorded cached tokens, TTFT, total.

    Example: prefixtrace replay prefixtrace.db --target http://127.0.0.1:8080 --out replay.json
    """
    from analyzer import load_turns
    from recorder.replay import format_replay, replay as run_replay, write_report

    turns = [t for t in load_turns(src) if session is None or t.session_id == session]
    report = run_replay(turns, target)
    click.echo(format_replay(report))
    if out:
        write_report(report, out)


@click.group()
def db():
    """Inspect a recorder database.

    Example: prefixtrace db info prefixtrace.db
    """


@db.command()
@DB
@library_errors
def info(db):
    """Sessions, turns, size and date range of a recorder database.

    Example: prefixtrace db info prefixtrace.db
    """
    from recorder import db_info

    write_or_echo(json.dumps(db_info(db), indent=2), None)


COMMANDS = [export, import_, replay, db]

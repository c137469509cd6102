"""`prefixtrace analyze` and `prefixtrace check`: thin shells over `analyzer`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from prefixtrace.cli_common import library_errors, write_or_echo

SRC = click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))


@click.command()
@SRC
@click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Count tokens with this model directory's tokenizer (default: tiktoken o200k_base, else a regex splitter).")
@click.option("--tokenizer", "tokenizer_spec", metavar="SPEC", help="'regex', 'tiktoken:NAME' or a tokenizer.json path.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the report here instead of stdout.")
@click.option("--session", help="Only this session.")
@library_errors
def analyze(src, model, tokenizer_spec, fmt, out, session):
    """Per session and turn: prompt tokens, reported cached tokens, common prefix
    with the previous turn, and where the prompt first diverged.

    SRC is a recorder database or a JSONL file (wrapped records or bare request
    bodies, see docs/FORMATS.md); sessions without ids are inferred.

    Example: prefixtrace analyze prefixtrace.db --format json --out report.json
    """
    from analyzer import analyze as run_analyze, format_text, to_json

    reports = run_analyze(src, tokenizer=str(model) if model else tokenizer_spec, session=session)
    write_or_echo(format_text(reports) if fmt == "text" else to_json(reports), out)


@click.command()
@SRC
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@library_errors
def check(src, fmt):
    """Exit 0 when every request of every session extends the previous one, else 1.

    Meant for CI: record (or script) a harness session, then assert that its
    prompts only ever grow at the end, so the server's prefix cache keeps working.

    Example: prefixtrace check recorded-session.jsonl
    """
    from analyzer import check as run_check

    ok, problems = run_check(src)
    if fmt == "json":
        click.echo(json.dumps({"ok": ok, "problems": [p.to_dict() for p in problems]}, indent=2))
    elif ok:
        click.echo("ok: every request extends the previous one of its session")
    else:
        click.echo(f"{len(problems)} request(s) do not extend the previous one:")
        for problem in problems:
            click.echo(f"- {problem}")
    raise SystemExit(0 if ok else 1)

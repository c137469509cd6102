"""Helpers shared by the CLI modules: error translation and output."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from prefixtrace.errors import PrefixtraceError


def library_errors(fn):
    """Turn a library error into a clean CLI error (message, exit status 1)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PrefixtraceError as exc:
            raise click.ClickException(exc.message) from exc

    return wrapper


def write_or_echo(text: str, out: Path | None) -> None:
    if out is None:
        click.echo(text)
    else:
        out.write_text(text if text.endswith("\n") else text + "\n")
        click.echo(f"wrote {out}", err=True)

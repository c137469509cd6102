"""Helpers shared by the CLI modules: error translation, output and progress."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sqlite3
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import click

from prefixtrace.common.errors import PrefixtraceError
from prefixtrace.common.escaping import visible


def library_errors(fn):
    """Turn a library error into a clean CLI error (message, exit status 1); a
    database that SQLite cannot read is one line too, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PrefixtraceError as exc:
            raise click.ClickException(visible(exc.message)) from exc
        except OSError as exc:  # an output file that cannot be written, a disk that filled up...
            where = f"{exc.filename}: " if exc.filename else ""
            raise click.ClickException(visible(f"{where}{exc.strerror or exc}")) from exc
        except RecursionError as exc:  # JSON (or another input) nested past the parser's recursion limit
            raise click.ClickException("the input is nested too deeply to read (past the JSON parser's "
                                       "recursion limit): the file is damaged or crafted") from exc
        except sqlite3.Error as exc:  # not a database, a damaged one, a locked one...
            raise click.ClickException(f"cannot read the database: {visible(str(exc))} "
                                       f"({type(exc).__name__})") from exc

    return wrapper


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also rejects nan and inf (which compare false to any bound)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


def output_path(ctx, param, value):
    """Callback of an output-file option: its directory must exist, checked before any work is done."""
    if value is not None and not Path(value).absolute().parent.is_dir():
        raise click.BadParameter(f"directory {str(Path(value).parent)!r} does not exist.", ctx, param)
    return value


def write_or_echo(text: str, out: Path | None) -> None:
    """Print `text`, or write it to `out`: either way a person reads it, so control
    characters that came from clients are shown, not acted on (`visible`)."""
    text = visible(text)
    if out is None:
        click.echo(text)
    else:
        from recorder.files import write_private_text  # 0600: a report holds client data

        write_private_text(out, text if text.endswith("\n") else text + "\n")
        click.echo(f"wrote {out}", err=True)


def echo(text: str, err: bool = False) -> None:
    """click.echo of text that may hold client data (see `write_or_echo`)."""
    click.echo(visible(text), err=err)


JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of a table.")


def echo_json(value) -> None:
    click.echo(json.dumps(value, indent=2, default=str))  # ASCII: no raw control character can get through


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def progress(label: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
    """Yields `advance(n=1)`. Draws a bar (or, with no `total`, a status line)
    on stderr only when stderr is a terminal, and erases it when done; else
    draws nothing, so pipes, logs and --json output stay clean."""
    if not stderr_is_tty():
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn("{task.description}"), BarColumn(), *([MofNCompleteColumn()] if total else []),
               TimeElapsedColumn()]
    # No refresh thread without a total: analyze forks worker processes, and a
    # thread writing to stderr at fork time could leave a child a locked stream.
    with Progress(*columns, console=Console(stderr=True), transient=True, auto_refresh=total is not None) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n=1: bar.advance(task, n)

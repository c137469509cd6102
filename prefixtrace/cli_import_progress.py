"""`import`'s progress line and its handling of SIGTERM, for a streamed import of a large file.

The line (stderr, and only when stderr is a terminal: a pipe or a log gets nothing) shows the bytes
read of the file's size, the turns written, and the read rate; rich draws it and erases it when the
import ends. SIGTERM is turned into the KeyboardInterrupt that Ctrl-C raises, so both stop the import
the same way: the batch in flight is rolled back, what was committed stays, and the message says
where it stopped (recorder/transcripts/streamed.py).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator

from prefixtrace.cli_common import stderr_is_tty


@contextlib.contextmanager
def import_progress(name: str) -> Iterator[Callable | None]:
    """Yields the `on_progress` callback for `import_path` (None when stderr is not a terminal). A
    long file name (a Codex rollout's is 70 characters) is shortened so the line fits 100 columns."""
    if not stderr_is_tty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TransferSpeedColumn

    columns = [TextColumn("{task.description}"), BarColumn(bar_width=16), TextColumn("{task.fields[read]}"),
               TransferSpeedColumn(), TextColumn("{task.fields[turns]:,} turns written")]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        label = name if len(name) <= 24 else name[:10] + "…" + name[-13:]
        task = bar.add_task(f"importing {label}", total=None, turns=0, read="")

        def on_progress(p) -> None:
            bar.update(task, completed=p.read_bytes, total=p.total_bytes, turns=p.turns,
                       read=f"{p.read_bytes / 1e6:,.1f} of {p.total_bytes / 1e6:,.1f} MB")

        yield on_progress


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside the block (the main thread's), as Ctrl-C does."""
    try:
        previous = signal.signal(signal.SIGTERM, _terminated)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

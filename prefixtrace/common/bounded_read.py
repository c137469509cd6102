"""Reading a file someone else may have put in place, within a size bound.

A path taken from a recording, a config or the command line can name a FIFO (a read that never
returns), `/dev/zero` (a read that never ends) or a file of gigabytes. `read_regular` opens it
without blocking, refuses anything but a regular file, and reads at most `max_bytes` + 1.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from prefixtrace.common.errors import InvalidRequest


def read_regular(path: str | Path, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of the regular file at `path` (symlinks followed), or InvalidRequest in one line
    when it is missing, not a regular file, or larger than `max_bytes`."""
    p = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InvalidRequest(f"cannot read {what} {p}: {exc.strerror or exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidRequest(f"cannot read {what} {p}: not a regular file")
        if info.st_size > max_bytes:
            raise InvalidRequest(f"cannot read {what} {p}: {info.st_size:,} bytes, over the {max_bytes:,} allowed")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise InvalidRequest(f"cannot read {what} {p}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew since the stat
        raise InvalidRequest(f"cannot read {what} {p}: over the {max_bytes:,} bytes allowed")
    return data


def read_regular_text(path: str | Path, max_bytes: int, what: str = "file") -> str:
    """`read_regular` decoded as UTF-8 (InvalidRequest when it is not)."""
    try:
        return read_regular(path, max_bytes, what).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"cannot read {what} {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None

"""Files the tool writes for a person to read (exports, reports, the recorder's spool): owner-only.

Each holds prompts, replies and session ids from clients (secrets redacted, the rest of the
code and conversation not), like the database itself (`recorder.schema`), so each is created
0600 whatever the umask, and a file it replaces is set to 0600 too: what we write into it is
ours to protect. `O_NOFOLLOW` keeps a planted symlink from redirecting the write.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO

PRIVATE_MODE = 0o600


def open_private(path: str | Path, mode: str = "w", *, encoding: str | None = "utf-8") -> IO:
    """`open(path, mode)` for writing ("w", "a", "wb", "ab"), the file 0600 from its creation."""
    if mode not in ("w", "a", "wb", "ab"):
        raise ValueError(f"open_private writes only; got mode {mode!r}")
    flags = os.O_WRONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    flags |= os.O_APPEND if mode.startswith("a") else os.O_TRUNC
    fd = os.open(path, flags, PRIVATE_MODE)
    try:
        os.fchmod(fd, PRIVATE_MODE)  # an existing file, or a umask that took bits away from the mode above
        return os.fdopen(fd, mode, encoding=None if "b" in mode else encoding)
    except BaseException:
        os.close(fd)
        raise


def write_private_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """`Path(path).write_text(text)`, the file 0600."""
    with open_private(path, "w", encoding=encoding) as fh:
        fh.write(text)

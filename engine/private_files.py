"""Owner-only files and directories for what the engine keeps on disk.

Block files and spill files hold prompt token ids, and token ids decode back
to the prompt: whatever a client sent, secrets the recorder redacts included
(docs/CACHE.md, docs/SECURITY.md). So directories are 0700 and files 0600
whatever the umask, set explicitly after creation (a umask can only remove
bits, and an existing directory keeps the mode it had).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE, FILE_MODE = 0o700, 0o600


def private_dir(path: Path) -> Path:
    """Create `path` (and missing parents, which keep the umask's mode) and make it 0700."""
    path.mkdir(parents=True, exist_ok=True)
    if stat.S_IMODE(path.stat().st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def open_private(path: Path) -> int:
    """A new (or truncated) file for writing, 0600, never through a symlink; returns the fd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    os.fchmod(fd, FILE_MODE)  # the umask may have taken bits away; nothing may have been added
    return fd


def make_private(path: Path) -> None:
    """Tighten a file some other code created (mx.save_safetensors) to 0600."""
    os.chmod(path, FILE_MODE)

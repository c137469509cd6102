"""What `serve` checks before it loads a model, and what it prints once ready.

A model takes seconds to minutes to load (the bundled default is converted on
first use); a port already taken or a database that cannot be written would
otherwise surface only after that, as a raw `[Errno 98]`, with a half-created
database left behind. So the listening socket is claimed and the database's
place is checked first, in well under a second, and nothing is created when
either fails.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from prefixtrace.common.errors import ServeRefused


def claim_port(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), bound now so a busy port fails before
    the model loads; uvicorn serves on it (`Server.run(sockets=[...])`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn binds: a port left in TIME_WAIT by a previous run is reusable,
        # one with a live listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ServeRefused(f"port {port} on {host} is already in use (another `prefixtrace serve`?): stop that "
                               f"server or pick another port with --port N (--port 0 takes a free one)") from exc
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ServeRefused(f"cannot listen on {host}: no such address on this machine; use --host 127.0.0.1 "
                               "(or an address this machine has)") from exc
        if exc.errno == errno.EACCES:
            raise ServeRefused(f"port {port} needs privileges to listen on; pick one above 1023 with --port") from exc
        raise ServeRefused(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(False)
    return sock


def check_database_writable(path: Path) -> None:
    """Refuse a --db that cannot be written, without creating anything.

    SQLite in WAL mode writes two files beside the database (`-wal`, `-shm`),
    so its directory must be writable too, not only the file."""
    path = Path(path)
    directory = path.absolute().parent
    if path.is_dir():
        raise ServeRefused(f"--db {path} is a directory: give a file path, e.g. --db {path / 'prefixtrace.db'}")
    if not directory.is_dir():
        raise ServeRefused(f"cannot record to {path}: directory {directory} does not exist; create it or pass "
                           "--db PATH in an existing directory")
    if _read_only_filesystem(directory):
        raise ServeRefused(f"cannot record to {path}: {directory} is on a read-only filesystem; pass --db PATH "
                           "on a writable one")
    if path.exists() and not os.access(path, os.R_OK | os.W_OK):
        raise ServeRefused(f"cannot record to {path}: the file is not writable by this user; fix its permissions "
                           "or pass --db PATH")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ServeRefused(f"cannot record to {path}: directory {directory} is not writable (SQLite writes its "
                           "journal beside the database); pass --db PATH in a writable directory")


def _read_only_filesystem(directory: Path) -> bool:
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def ready_banner(base_url: str, db: Path) -> list[str]:
    """Lines printed once the server answers: where it is, where it records, and how
    each harness in docs/HARNESSES.md is pointed at it."""
    root = base_url.removesuffix("/v1")
    return [
        f"prefixtrace is ready: {base_url}  (dashboard {root}/ui, recording to {db})",
        f"  point a harness here: OpenAI clients (codex, opencode, qwen-code, aider, llm, pi) base URL {base_url}; "
        f"Claude Code ANTHROPIC_BASE_URL={root}; model name 'default', any API key. Per harness: docs/HARNESSES.md",
    ]

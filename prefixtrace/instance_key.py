"""The per-instance secret a `prefixtrace serve` keeps for `prefixtrace run` to check it by
(prefixtrace/common/instance_proof.py): one 0600 file per port in a directory only the user can enter,
`$XDG_RUNTIME_DIR/prefixtrace/` (else `~/.local/state/prefixtrace/instances/`)."""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path


class UnsafeKeyDir(OSError):
    """The key directory is someone else's or others can read it: no secret is kept there."""


def key_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "prefixtrace"
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "prefixtrace" / "instances"


def key_file(port: int) -> Path:
    return key_dir() / f"serve-{port}.json"


def _private_dir() -> Path:
    path = key_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise UnsafeKeyDir(f"{path} is not a directory only you can enter")
    return path


def write_key(port: int, db: Path) -> tuple[Path, bytes]:
    """A fresh secret for the serve on `port`, written where only this user can read it."""
    secret = secrets.token_bytes(32)
    path = _private_dir() / f"serve-{port}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"secret": secret.hex(), "pid": os.getpid(), "db": str(db)}, out)
    os.replace(tmp, path)
    return path, secret


def read_key(port: int) -> bytes | None:
    """The secret of the serve on `port`, or None where there is none this user wrote alone."""
    try:
        path = _private_dir() / f"serve-{port}.json"
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        info = os.fstat(f.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o077 or info.st_size > 4096:
            return None
        try:
            return bytes.fromhex(json.load(f)["secret"])
        except (ValueError, KeyError, TypeError):
            return None


def remove_key(path: Path, secret: bytes) -> None:
    """Removes the file unless a later serve on the same port has written its own."""
    try:
        if bytes.fromhex(json.loads(path.read_text())["secret"]) == secret:
            path.unlink()
    except (OSError, ValueError, KeyError, TypeError):
        pass


def proven_db(url: str, timeout: float = 5.0) -> str | None:
    """The database of the `prefixtrace serve` at `url` when it proves it holds the secret this
    user's serve keeps for that port (prefixtrace/common/instance_proof.py); None for anything else."""
    import httpx

    from prefixtrace.common.instance_proof import PROOF_PATH, verify

    try:
        port = httpx.URL(url).port or (443 if url.startswith("https") else 80)
    except (httpx.InvalidURL, ValueError):
        return None
    secret = read_key(port)
    if secret is None:
        return None
    nonce = secrets.token_hex(16)
    try:
        answer = httpx.get(url.rstrip("/") + PROOF_PATH, params={"nonce": nonce}, timeout=timeout).json()
        db, given = answer["db"], answer["proof"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return db if isinstance(db, str) and isinstance(given, str) and verify(secret, nonce, db, given) else None

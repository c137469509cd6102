"""The one prefix key: a chained hash over fixed-size blocks of token ids.

Block i's key is H(key of block i-1, token ids of block i); block 0's parent is
a root key that binds the chain to one model (its fingerprint) and one cache
format ("dense/float32", later a codec's name). A key therefore names one
exact token prefix of one model's KV in one format, and two prompts share a
key exactly when they share that whole prefix. The prefix cache (memory and
disk) keys its blocks with it, and the model loaders use its `file_digest` for a
model's content identity; it imports only the standard library, so hashing a
prompt's blocks never needs MLX.

    keys = block_hashes(token_ids, 256, model_fingerprint=fp, cache_format="dense/float32")

The same `chain_hash` also keys a sequence's partial tail (fewer than
`block_size` tokens after its last full block): the key still names one exact
prefix, so no separate scheme is needed for tails.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from array import array
from pathlib import Path

log = logging.getLogger("prefixtrace.cache")
KEY_BYTES = 16  # 128-bit keys: collisions are out of reach for any cache size
_SCHEME = b"prefixtrace-block-v1"


def root_hash(*, model_fingerprint: str, cache_format: str) -> bytes:
    """The parent of block 0: the chain's binding to a model and a cache format."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in (_SCHEME, model_fingerprint.encode(), cache_format.encode()):
        h.update(len(part).to_bytes(4, "little"))  # length-prefixed: no ambiguous joins
        h.update(part)
    return h.digest()


def chain_hash(parent: bytes, token_ids) -> bytes:
    """The key of the block `token_ids` that follows the block keyed `parent`."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(array("I", token_ids).tobytes())  # uint32 ids; the count is implied by the byte length
    return h.digest()


def block_hashes(token_ids, block_size: int, *, model_fingerprint: str, cache_format: str) -> list[bytes]:
    """Keys of every full block of `token_ids` (a trailing partial block gets none)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = root_hash(model_fingerprint=model_fingerprint, cache_format=cache_format)
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


# The files whose content is the model as the cache sees it: its shape (config), how text becomes
# token ids (tokenizer) and its weights. Not the chat template or generation defaults: they change
# which tokens a prompt has, never what a token prefix's KV is.
_IDENTITY_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                   "tokenizer.model", "special_tokens_map.json")
_IDENTITY_SCHEME = b"prefixtrace-model-content-v1"
IDENTITY_SIDECAR = "model-identity.json"  # in the disk cache's directory (engine/prefix_cache.py)
SIDECAR_ENTRIES = 256  # files remembered by one sidecar (several models may share a cache directory)


def model_fingerprint(model_dir: str | Path, sidecar: str | Path | None = None) -> str:
    """A short id of the model whose KV a cache holds: its content.

    A hash over the content hashes of config.json, the tokenizer files, the safetensors index and
    every weight file, by name. A copy of the directory, a second install or a re-conversion that
    writes the same bytes is the same model, so its disk cache stays warm (issue 25: the id used
    to include the files' mtimes, and every install or re-conversion started cold).

    Hashing every weight byte takes seconds on a large model, so each file's hash is kept in the
    JSON `sidecar` (the disk cache directory's `model-identity.json`) with the file's size and
    mtime, and read again only when they change: a file rewritten in place with the same size
    and mtime keeps its old hash (as the id did before). Without a sidecar every file is hashed.
    """
    model_dir = Path(model_dir)
    files = [model_dir / name for name in _IDENTITY_FILES if (model_dir / name).is_file()]
    files += sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    known = _read_sidecar(sidecar)
    changed = False
    t0, hashed_bytes = time.perf_counter(), 0
    h = hashlib.blake2b(_IDENTITY_SCHEME, digest_size=KEY_BYTES)
    for path in files:
        st = path.stat()
        where = str(path.resolve())
        entry = known.get(where)
        if entry is not None and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns \
                and isinstance(entry.get("blake2b"), str):
            digest = entry["blake2b"]
        else:
            digest = file_digest(path)
            hashed_bytes += st.st_size
            known.pop(where, None)
            known[where] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "blake2b": digest}
            changed = True
        h.update(json.dumps([path.name, digest]).encode())
    if changed and sidecar is not None:
        _write_sidecar(Path(sidecar), known)
    if hashed_bytes > 1 << 20:
        log.info("model identity: hashed %.0f MB of %s in %.1f s (once: kept in %s)", hashed_bytes / 1e6, model_dir,
                 time.perf_counter() - t0, sidecar or "no sidecar")
    return h.hexdigest()


def file_digest(path: Path) -> str:
    """The blake2b (128-bit) of a file's bytes, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=KEY_BYTES)).hexdigest()


def _read_sidecar(sidecar: str | Path | None) -> dict:
    if sidecar is None:
        return {}
    try:
        data = json.loads(Path(sidecar).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # none yet, or damaged: the hashes are computed again
    return data if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()) else {}


def _write_sidecar(sidecar: Path, known: dict) -> None:
    """Replace the sidecar whole (temp file + rename: a concurrent reader sees the old or the new
    one); the most recently hashed files are kept. A sidecar that cannot be written costs only a
    re-hash at the next start."""
    keep = dict(list(known.items())[-SIDECAR_ENTRIES:])
    tmp = sidecar.with_name(f".{sidecar.name}.{os.getpid()}.tmp")
    try:
        sidecar.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(keep, f)
        os.replace(tmp, sidecar)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass

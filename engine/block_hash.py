"""The one prefix key: a chained hash over fixed-size blocks of token ids.

Block i's key is H(key of block i-1, token ids of block i); block 0's parent is
a root key that binds the chain to one model (its fingerprint) and one cache
format ("dense/float32", later a codec's name). A key therefore names one
exact token prefix of one model's KV in one format, and two prompts share a
key exactly when they share that whole prefix. The prefix cache keys its
blocks with it; the recorder and the analyzer import it to talk about the same
blocks without loading MLX (this module imports only the standard library).

    keys = block_hashes(token_ids, 256, model_fingerprint=fp, cache_format="dense/float32")

The same `chain_hash` also keys a sequence's partial tail (fewer than
`block_size` tokens after its last full block): the key still names one exact
prefix, so no separate scheme is needed for tails.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from pathlib import Path

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


def model_fingerprint(model_dir: str | Path) -> str:
    """A short id of the model whose KV a cache holds.

    Content of config.json and of the safetensors index (if any), plus each
    weight file's name, size and modification time. Reading every weight byte
    would cost seconds per start on large models; size + mtime changes whenever
    a file is rewritten (re-conversion, re-download), which is what makes a
    stale cache wrong. Copying a model directory elsewhere keeps names and
    sizes but usually not mtimes, so a copy starts with a cold disk cache: a
    miss, never a wrong hit.
    """
    model_dir = Path(model_dir)
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for name in ("config.json", "model.safetensors.index.json"):
        path = model_dir / name
        if path.exists():
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    for path in sorted(model_dir.glob("*.safetensors")):
        st = path.stat()
        h.update(json.dumps([path.name, st.st_size, st.st_mtime_ns]).encode())
    return h.hexdigest()

"""Move one sequence's KV out of memory and back, exactly.

A paused or parked sequence's per-layer KV is written to a request-keyed
safetensors file and its arrays are released; resuming loads the same bytes
back into fresh `KVCache` objects, so the resumed computation sees bit-for-bit
the cache it left. The files live in a private temporary directory (or
`spill_dir`) and are deleted on resume.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine.private_files import make_private, private_dir
from prefixtrace.common.errors import EngineError


class SpillStore:
    """`spill_dir`: where the files go; None, a private temporary directory made on the first spill
    (most servers never spill, and one made at start was left empty by every stopped `serve`) and
    removed by `close()`, which the engine calls as its thread ends."""

    def __init__(self, spill_dir: str | Path | None = None):
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._dir = private_dir(Path(spill_dir)) if spill_dir is not None else None  # prompt content: owner-only
        self.bytes_written = 0

    @property
    def dir(self) -> Path:
        if self._dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="prefixtrace-spill-")
            self._dir = private_dir(Path(self._tmp.name))
        return self._dir

    @dir.setter
    def dir(self, path: Path) -> None:
        self._dir = Path(path)

    def close(self) -> None:
        """Removes the temporary directory this store made, with any file still in it (a paused
        request's KV is worthless once the engine stops); a directory the caller gave is left."""
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp, self._dir = None, None

    def spill(self, key: str, cache: list) -> Path:
        arrays, meta = {}, {"layers": str(len(cache))}
        for i, layer in enumerate(cache):
            if isinstance(layer, KVCache):
                if layer.keys is not None:
                    arrays[f"{i}.k"] = layer.keys[..., : layer.offset, :]
                    arrays[f"{i}.v"] = layer.values[..., : layer.offset, :]
                continue
            # Other cache types (TurboQuant) round-trip through mlx-lm's cache
            # protocol: `state` arrays plus `meta_state` strings.
            meta[f"{i}.class"] = type(layer).__name__
            meta[f"{i}.meta"] = json.dumps(list(layer.meta_state))
            state = list(layer.state)
            meta[f"{i}.n"] = str(len(state))
            for j, array in enumerate(state):
                if array is not None:
                    arrays[f"{i}.s{j}"] = array
        path = self.dir / f"{key}.safetensors"
        try:
            private_dir(self.dir)  # removed while running: made again
            mx.save_safetensors(str(path), arrays, meta)
            make_private(path)  # already unreachable for others inside the 0700 directory
            self.bytes_written += path.stat().st_size
        except Exception as exc:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            raise EngineError(f"could not spill KV to {path}: {exc}", retryable=True) from exc
        return path

    def restore(self, path: Path, tokens: int | None = None) -> list[KVCache]:
        """The caches spilled to `path` (deleted either way); with `tokens`, dense layers must
        hold exactly that many, else the file is not the one this request wrote."""
        try:
            cache = self._restore(path)
            if tokens is not None and any(isinstance(c, KVCache) and c.offset != tokens for c in cache):
                raise ValueError(f"it does not hold the paused request's {tokens} tokens")
            return cache
        except Exception as exc:
            raise EngineError(f"could not read back spilled KV from {path}: {exc}", retryable=True) from exc
        finally:
            with contextlib.suppress(OSError):  # read back or unreadable, it is never read again
                path.unlink(missing_ok=True)

    def _restore(self, path: Path) -> list[KVCache]:
        arrays, meta = mx.load(str(path), return_metadata=True)
        cache = []
        for i in range(int(meta["layers"])):
            if f"{i}.class" in meta:
                cls = _other_cache_classes()[meta[f"{i}.class"]]
                state = [arrays.get(f"{i}.s{j}") for j in range(int(meta[f"{i}.n"]))]
                layer = cls.__new__(cls)
                layer.state = state if any(a is not None for a in state) else []
                layer.meta_state = json.loads(meta[f"{i}.meta"])
                cache.append(layer)
                continue
            layer = KVCache()
            if f"{i}.k" in arrays:
                layer.keys, layer.values = arrays[f"{i}.k"], arrays[f"{i}.v"]
                layer.offset = layer.keys.shape[2]
            cache.append(layer)
        mx.eval(list(arrays.values()))
        return cache


def _other_cache_classes() -> dict:
    from engine.tq_cache import TurboQuantKVCache

    return {"TurboQuantKVCache": TurboQuantKVCache}

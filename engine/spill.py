"""Move one sequence's KV out of memory and back, exactly.

A paused or parked sequence's per-layer KV is written to a request-keyed
safetensors file and its arrays are released; resuming loads the same bytes
back into fresh `KVCache` objects, so the resumed computation sees bit-for-bit
the cache it left. The files live in a private temporary directory (or
`spill_dir`) and are deleted on resume.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class SpillStore:
    def __init__(self, spill_dir: str | Path | None = None):
        if spill_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="prefixtrace-spill-")
            spill_dir = self._tmp.name
        self.dir = Path(spill_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.bytes_written = 0

    def spill(self, key: str, cache: list[KVCache]) -> Path:
        arrays = {}
        for i, layer in enumerate(cache):
            if layer.keys is not None:
                arrays[f"{i}.k"] = layer.keys[..., : layer.offset, :]
                arrays[f"{i}.v"] = layer.values[..., : layer.offset, :]
        path = self.dir / f"{key}.safetensors"
        mx.save_safetensors(str(path), arrays, {"layers": str(len(cache))})
        self.bytes_written += path.stat().st_size
        return path

    def restore(self, path: Path) -> list[KVCache]:
        arrays, meta = mx.load(str(path), return_metadata=True)
        cache = []
        for i in range(int(meta["layers"])):
            layer = KVCache()
            if f"{i}.k" in arrays:
                layer.keys, layer.values = arrays[f"{i}.k"], arrays[f"{i}.v"]
                layer.offset = layer.keys.shape[2]
            cache.append(layer)
        mx.eval([c.state for c in cache if c.keys is not None])
        path.unlink(missing_ok=True)
        return cache

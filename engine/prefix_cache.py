"""Paged prefix cache: KV in hashed blocks, in memory and on disk.

A prompt's KV is cut into blocks of `block_size` tokens keyed by the chained
hash of engine/block_hash.py, plus the exact tail after its last full block.
`lookup` walks the prompt's chain through the memory tier, then the disk tier
(a disk hit is promoted to memory), and where the chain stops it takes the
longest common prefix with any cached child of the last matched block (a full
block or a tail) and reuses that many of its positions. So `num_cached` is
the exact common prefix with what is cached, not a block multiple
(docs/CACHE.md, "Exactness").

Engine thread only: the scheduler calls `lookup` on admission, `commit` after
prefill chunks (progress survives a cancel, an abort or a restart) and
`store` when a sequence ends. Disk writes leave the engine thread as host
copies for the writer thread of engine/disk_cache.py.

Only models whose caches are all plain `KVCache` layers are paged; for others
(sliding windows, SSM state) the cache stays empty and says so once in the log.
With a `TQConfig` (kv_quant="turboquant") the blocks hold each TurboQuant
layer's norms and codes (and the dense layers dense) under their own format,
and `lookup` returns `TurboQuantKVCache`s ready to use (docs/CACHE.md,
"TurboQuant blocks").
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engine.block_hash import IDENTITY_SIDECAR, chain_hash, model_fingerprint, root_hash
from engine.cache_blocks import (DENSE, Block, TQLayer, block_arrays, cut, cut_shared, flat_staging, from_numpy,
                                 is_dense, join, named_arrays, stage, staged_arrays)
from engine.disk_cache import DiskCache
from engine.memory_cache import MemoryCache
from engine.tq_config import TQConfig
from engine.turboquant import get_codec
from prefixtrace.common.errors import EngineError

log = logging.getLogger("prefixtrace.cache")

DEFAULT_BLOCK_SIZE = 256  # measured in bench/bench_cache_tiers.py, justified in docs/CACHE.md
DEFAULT_DISK_BYTES = 16 << 30
# Commit during prefill once this many new full blocks are done. Each block is
# copied once whether a commit or the final store copies it, so committing
# every block costs only the chain hashing (see docs/CACHE.md).
DEFAULT_COMMIT_BLOCKS = 1


@dataclass(slots=True)
class CacheHit:
    cache: list[Any]  # per-layer KV caches holding exactly `num_cached` tokens
    num_cached: int


class PrefixCache:
    """Args:
    model: the mlx-lm model (probed once with one token for its KV layout and dtype).
    max_bytes: byte budget of the memory tier.
    block_size: tokens per block.
    cache_dir: directory of the disk tier (None: memory only).
    disk_bytes: byte budget of the disk tier.
    model_dir: the model's directory, fingerprinted into every key; required with cache_dir.
    commit_blocks: commit during prefill every this many new full blocks.
    tq: TurboQuant settings (None: the engine's KV is dense); the blocks and keys follow them.
    """

    def __init__(self, model, *, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE,
                 cache_dir: str | Path | None = None, disk_bytes: int = DEFAULT_DISK_BYTES,
                 model_dir: str | Path | None = None, commit_blocks: int = DEFAULT_COMMIT_BLOCKS,
                 tq: TQConfig | None = None):
        if block_size <= 0 or commit_blocks <= 0:
            raise EngineError(f"block_size and commit_blocks must be positive ({block_size}, {commit_blocks})")
        self._model = model
        self.block_size = block_size
        self.commit_blocks = commit_blocks
        self.tq = tq
        probe = make_prompt_cache(model)
        self.enabled = is_dense(probe)
        self._dense_layers: set[int] = set(range(len(probe)))
        if self.enabled:
            model(mx.array([[0]]), cache=probe)  # one token: the KV dtype the model really produces
            self._layout = [(tuple(c.keys.shape[:2]), tuple(c.keys.shape[3:]), c.keys.dtype) for c in probe]
            self._dims = [(c.keys.shape[-1], c.values.shape[-1], c.keys.dtype) for c in probe]
            dtype = str(probe[0].keys.dtype).removeprefix("mlx.core.")
            self.block_format, self.cache_format = DENSE, f"{DENSE}/{dtype}"
            if tq is not None:
                self._dense_layers = tq.dense_set(len(probe))
                self.block_format = tq.block_format
                self.cache_format = f"{tq.block_format}/{dtype}/dense={','.join(map(str, sorted(self._dense_layers)))}"
        else:
            log.warning("prefix cache disabled: the model's cache layers are not all plain KVCache")
            self.block_format = self.cache_format = "none"
        if cache_dir is not None and (model_dir is None or not (Path(model_dir) / "config.json").exists()):
            raise EngineError("a disk prefix cache needs the model's directory (with config.json) to key its blocks")
        # A memory-only cache lives and dies with this model object: any unique id will do.
        # The model's content hashes are kept beside the blocks they key (engine/block_hash.py).
        sidecar = Path(cache_dir) / IDENTITY_SIDECAR if cache_dir is not None else None
        fingerprint = model_fingerprint(model_dir, sidecar) if model_dir is not None \
            else f"process-{os.getpid()}-{id(model)}"
        self.root = root_hash(model_fingerprint=fingerprint, cache_format=self.cache_format)
        self.memory = MemoryCache(max_bytes)
        self.disk = DiskCache(cache_dir, max_bytes=disk_bytes) if cache_dir is not None and self.enabled else None
        # No tier can take a block (a zero memory budget and no disk): nothing is copied.
        self._keeps = max_bytes > 0 or self.disk is not None
        self.num_lookups = 0
        self.num_hit_tokens = 0
        self.num_disk_blocks_read = 0
        self.disk_bytes_read = 0
        self.disk_read_s = 0.0
        # Blocks copied for the disk tier whose copies are not evaluated yet: handed to the
        # writer by `settle` once the caller's `mx.eval` has run (key -> (parent, tokens, staged)).
        self._unwritten: dict[bytes, tuple] = {}
        # Keys the memory tier refused (only their own chain was left to evict) since the last
        # lookup or store: later commits of the same prefill do not copy them again.
        self._refused: set[bytes] = set()
        # The chain of the last token sequence hashed: a prefill's commits extend it.
        self._memo: tuple[list[int], list[bytes]] = ([], [])
        # On a GPU the disk writer reads its own copy of a block (cache_blocks.stage).
        self._stage_copy = mx.default_device().type != mx.DeviceType.cpu
        if self.disk is not None:
            flat_staging(self._stage_copy)  # on CUDA: the driver copy checked once now, not in a prefill

    # --- asking -----------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.memory.nbytes

    def __len__(self) -> int:
        return len(self.memory)

    @property
    def evictions(self) -> int:
        """Blocks this cache has lost for room since it started: the disk tier's when there is one (a
        block the memory tier drops is still on disk), else the memory tier's. Any thread may read it."""
        return self.disk.evictions if self.disk is not None else self.memory.evictions

    @property
    def stats(self) -> dict:
        disk = self.disk  # never `if self.disk`: DiskCache has __len__, so an empty one is falsy
        return {
            "block_size": self.block_size, "cache_format": self.cache_format,
            "memory_blocks": len(self.memory), "memory_bytes": self.memory.nbytes,
            "disk_blocks": len(disk) if disk is not None else 0, "disk_bytes": disk.nbytes if disk is not None else 0,
            "disk_blocks_read": self.num_disk_blocks_read, "disk_bytes_read": self.disk_bytes_read,
            "disk_read_s": self.disk_read_s, "disk_corrupt": disk.num_corrupt if disk is not None else 0,
            "lookups": self.num_lookups, "hit_tokens": self.num_hit_tokens,
        }

    def lookup(self, tokens: list[int], *, room: int = 0) -> CacheHit:
        """A private cache holding the longest cached prefix of `tokens`, never all of them.

        room: free positions to leave after the restored ones in dense layers (the scheduler
        asks for the prompt's rest plus one allocation step, so the prefill that follows and
        the first decode steps write in place; see `join`)."""
        self.settle()
        self._refused.clear()
        self.num_lookups += 1
        limit = len(tokens) - 1  # the step that samples the first output token needs an input
        if not self.enabled or limit <= 0:
            return CacheHit(self._empty(), 0)
        bs, parent, pos = self.block_size, self.root, 0
        parts, chain = [], []
        keys = self._held_chain(tokens[:limit])
        # The disk blocks of the chain are read and checked ahead on the reader
        # threads while this thread turns the earlier ones into MLX arrays.
        with self._disk_reads([k for k in keys if k not in self.memory]) as reads:
            for key in keys:
                block = self._fetch(key, reads)
                if block is None or list(block.tokens) != list(tokens[pos : pos + bs]):
                    break
                parts.append((block.layers, bs))
                chain.append(key)
                parent, pos = key, pos + bs
        tail, n = self._best_child(parent, tokens[pos:limit])
        if tail is not None:
            parts.append((tail.layers, n))
            chain.append(tail.key)
            pos += n
        if self.tq is not None:
            parts, pos = self._exact_tq_prefix(parts, pos)
        if not parts:
            return CacheHit(self._empty(), 0)
        self._touch(chain)
        cache = join(parts, tq=self.tq, dims=self._dims, room=max(0, room - pos) if room else 0)
        self.num_hit_tokens += pos
        return CacheHit(cache, pos)

    # --- acting -----------------------------------------------------------------

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep the KV of `cache`, whose first `cache[0].offset` tokens are `tokens[:offset]`.

        The cache object is taken over (the blocks are copies, so it is simply dropped).
        """
        self.settle()
        if not self._keeps or not self.pageable(cache) or cache[0].offset == 0:
            return
        offset = cache[0].offset
        mx.eval(self._keep(list(tokens[:offset]), cache, first=0, tail=True))
        self.settle()
        self._refused.clear()

    def commit(self, tokens: list[int], cache: list[Any], *, lazy: bool = False) -> list[mx.array]:
        """Keep the full blocks of a prefill in progress once `commit_blocks` new ones are done.

        `cache` stays the caller's: blocks are copied out of it. Cheap when
        nothing is new: the chain is extended from the previous commit's and the
        newest block found cached.

        lazy: the copies are left unevaluated and returned; the caller evaluates them
        together with its own work (the prefill chunk that produced them: one `mx.eval`,
        no sync per block) and then calls `settle` to hand the disk copies to the writer.
        """
        self.settle()
        if not self._keeps or not self.pageable(cache):
            return []
        bs, n_full = self.block_size, min(len(tokens), cache[0].offset) // self.block_size
        if n_full == 0:
            return []
        keys = self._chain(tokens[: n_full * bs])
        if self._done(keys[-1]):
            return []
        first = next(i for i, key in enumerate(keys) if not self._done(key))
        if n_full - first < self.commit_blocks:
            return []
        pending = self._keep(tokens[: n_full * bs], cache, first=first, tail=False)
        if not lazy:
            mx.eval(pending)
            self.settle()
            return []
        return pending

    def settle(self) -> None:
        """Hand the evaluated disk copies of committed blocks to the disk writer."""
        if not self._unwritten:
            return
        unwritten, self._unwritten = self._unwritten, {}
        # Started here, on the engine thread (MLX streams are per thread: the writer thread
        # could not). Normally the caller's eval has computed them, or, on a GPU, their
        # device copies, and the host copies run on MLX's CPU stream while the next chunk
        # computes; the writer waits for each as it takes it. After a step that failed
        # between `commit` and its eval this computes everything.
        mx.async_eval([staged_arrays(staged) for _, _, staged in unwritten.values()])
        for key, (parent, tokens, staged) in unwritten.items():
            self.disk.put(key, parent, tokens, staged, fmt=self.block_format, cache_format=self.cache_format)

    def pageable(self, cache: list) -> bool:
        """Whether `cache` is in this cache's format: all plain `KVCache`s, or with a
        `TQConfig` its TurboQuant layers (same bits, seed, group) and dense layers."""
        if not self.enabled or len(cache) != len(self._layout):
            return False
        if self.tq is None:
            return is_dense(cache)
        return all(type(c) is KVCache if i in self._dense_layers else self.tq.matches(c) for i, c in enumerate(cache))

    def pin(self, tokens: list[int]) -> int:
        """Protect the blocks of `tokens` (cached now or later) from eviction in both tiers;
        the number of tokens they cover. Pins last for this process only."""
        keys = self._keys_of(tokens)
        for key in keys:
            self.memory.pin(key)
            if self.disk is not None:
                self.disk.pin(key)
        return len(tokens) if keys else 0

    def holds(self, tokens: list[int]) -> bool:
        """Whether every block of `tokens` (its tail included) is in a tier now."""
        return bool(tokens) and all(
            key in self.memory or (self.disk is not None and key in self.disk) for key in self._keys_of(tokens)
        )

    def unpin(self, tokens: list[int]) -> None:
        for key in self._keys_of(tokens):
            self.memory.unpin(key)
            if self.disk is not None:
                self.disk.unpin(key)

    def flush(self) -> None:
        """Wait for queued disk writes (tests, benchmarks, shutdown)."""
        self.settle()
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        self.settle()
        if self.disk is not None:
            self.disk.close()

    # --- internals ----------------------------------------------------------------

    def _held_chain(self, tokens) -> list[bytes]:
        """The keys of `tokens`' full blocks up to the first one neither tier holds."""
        keys = self._chain(tokens)
        for i, key in enumerate(keys):
            if key not in self.memory and not self._on_disk(key):
                return keys[:i]
        return keys

    def _disk_reads(self, keys: list[bytes]):
        return self.disk.get_many(keys) if self.disk is not None and keys else contextlib.nullcontext()

    def _chain(self, tokens) -> list[bytes]:
        """The keys of `tokens`' full blocks. A prefill commits after every chunk, so the
        previous call's chain is reused as far as the tokens agree (one list comparison)
        and only the new blocks are hashed: hashing the whole prefix again per chunk is
        quadratic in the prompt."""
        if not isinstance(tokens, list):
            tokens = list(tokens)
        bs, n = self.block_size, len(tokens) // self.block_size
        memo_tokens, memo_keys = self._memo
        m = min(n, len(memo_keys))
        if m and tokens[: m * bs] != memo_tokens[: m * bs]:
            m = 0
        keys = memo_keys[:m]
        parent = keys[-1] if keys else self.root
        for start in range(m * bs, n * bs, bs):
            parent = chain_hash(parent, tokens[start : start + bs])
            keys.append(parent)
        if n > len(memo_keys) or m < len(memo_keys):
            self._memo = (list(tokens[: n * bs]), keys)
        return list(keys)

    def _empty(self) -> list:
        return self.tq.make_cache(self._model) if self.tq is not None else make_prompt_cache(self._model)

    def _keys_of(self, tokens) -> list[bytes]:
        keys = self._chain(tokens)
        rest = len(tokens) % self.block_size
        if rest:
            keys.append(chain_hash(keys[-1] if keys else self.root, tokens[-rest:]))
        return keys

    def _cached(self, key: bytes) -> bool:
        return key in self.memory and (self.disk is None or self._on_disk(key))

    def _on_disk(self, key: bytes) -> bool:
        return self.disk is not None and (key in self._unwritten or key in self.disk)

    def _done(self, key: bytes) -> bool:
        """Nothing left to copy for this block: cached in every tier, or the memory tier
        refused it during this prefill and the disk (if any) has it."""
        return self._cached(key) or (key in self._refused and (self.disk is None or self._on_disk(key)))

    def _keep(self, tokens: list[int], cache, *, first: int, tail: bool) -> list[mx.array]:
        """Copy blocks `first`.. of `tokens` (and the tail) out of `cache` into the tiers.

        The copies are lazy: the arrays to evaluate are returned, and the disk tier's
        copies wait in `_unwritten` for `settle` (after that evaluation)."""
        bs = self.block_size
        keys = self._chain(tokens)
        ends = [(i * bs, (i + 1) * bs, key) for i, key in enumerate(keys)]
        if tail and len(tokens) % bs:
            ends.append((len(keys) * bs, len(tokens), chain_hash(keys[-1] if keys else self.root, tokens[len(keys) * bs :])))
        chain, in_memory, pending = [], True, []
        for start, stop, key in ends:
            parent = keys[start // bs - 1] if start else self.root
            chain.append(key)
            if start < first * bs or self._cached(key):
                continue
            # A block goes to memory only below a parent memory holds (else it is stranded).
            in_memory = in_memory and (start == 0 or parent in self.memory)
            block = self.memory.get(key)
            if block is None:
                if not in_memory and self._on_disk(key):
                    # Memory refused an earlier block of this chain and the disk has this one:
                    # nothing to add, so no copy (each chunk's commit would otherwise copy the
                    # whole chain again past the first block memory could not hold).
                    continue
                if key in self._refused and (self.disk is None or self._on_disk(key)):
                    in_memory = False  # refused earlier in this prefill: not copied again
                    continue
                shared = None
                if self.disk is not None and not self._on_disk(key) and self._shared_staging():
                    shared = cut_shared(cache, start, stop, address=flat_staging(self._stage_copy))
                if shared is not None:  # one copy: the disk payload, and the block's layers as views of it
                    layers, staged = shared
                    block = Block(key, parent, tuple(tokens[start:stop]), layers)
                    pending += staged.arrays
                    self._unwritten[key] = (parent, block.tokens, staged)
                else:
                    block = Block(key, parent, tuple(tokens[start:stop]), cut(cache, start, stop, evaluate=False))
                pending += block_arrays(block.layers)
                self._drop_superseded(block)
                if in_memory and self.memory.can_hold(block.nbytes):
                    self.memory.put(block)  # may refuse it (budget full of its own chain)
                # Past a refused block the rest of the chain would be stranded in memory.
                in_memory = key in self.memory
                if not in_memory:
                    self._refused.add(key)
            if self.disk is not None and not self._on_disk(key) and key not in self._unwritten:
                staged, device = stage(named_arrays(block.layers), copy=self._stage_copy)
                pending += device if self._stage_copy else staged_arrays(staged)
                self._unwritten[key] = (parent, block.tokens, staged)
        self._touch(chain)
        return pending

    def _shared_staging(self) -> bool:
        """Whether a new block is cut straight into its disk payload (`cut_shared`): on CUDA with
        the driver copy (cache_blocks.flat_staging)."""
        return flat_staging(self._stage_copy)

    def _drop_superseded(self, block: Block) -> None:
        """A tail whose tokens begin `block`'s adds nothing once `block` is cached.

        Unless it is pinned: the pin holds that exact prefix (a parked prefill), and
        the longer block that covers it now is not pinned and may be evicted first."""
        n = block.num_tokens
        for other in self.memory.children(block.parent):
            if other.num_tokens < n and other.tokens == block.tokens[: other.num_tokens] \
                    and not self.memory.pinned(other.key):
                self.memory.discard(other.key)
        if self.disk is not None:
            for key, toks in self.disk.children(block.parent):
                if len(toks) < n and toks == block.tokens[: len(toks)] and not self.disk.pinned(key):
                    self.disk.discard(key)

    def _touch(self, chain: list[bytes]) -> None:
        # Most recent last, walking the chain backwards: a prefix's first blocks
        # are then evicted after its later ones, never before (a chain that lost
        # its head is useless).
        for key in reversed(chain):
            self.memory.get(key)

    def _best_child(self, parent: bytes, rest: list[int]) -> tuple[Block | None, int]:
        """The cached child of `parent` sharing the most leading tokens with `rest`, and how many."""
        if not rest:
            return None, 0
        rest = list(rest)
        candidates = [(_common(b.tokens, rest), 0, b.key) for b in self.memory.children(parent)]
        if self.disk is not None:
            candidates += [(_common(t, rest), 1, k) for k, t in self.disk.children(parent) if k not in self.memory]
        for n, _, key in sorted(candidates, key=lambda c: (-c[0], c[1])):
            if n == 0:
                break
            block = self._fetch(key)
            if block is not None and list(block.tokens[:n]) == rest[:n]:
                return block, n
        return None, 0

    def _fetch(self, key: bytes, reads=None) -> Block | None:
        """The block from memory, else from disk (through `reads` when it reads ahead), promoted to memory."""
        block = self.memory.get(key)
        if block is not None or self.disk is None:
            return block
        t0 = time.perf_counter()
        found = reads.take(key) if reads is not None else self.disk.get(key)
        if found is None:
            return None
        header, arrays = found
        if header.get("format") != self.block_format or header.get("cache_format") != self.cache_format:
            return None
        try:  # the arrays a checksummed header describes may still name no layer, or an unknown dtype
            layers = from_numpy(arrays)
            fits, why = self._fits_layout(layers, len(header["tokens"])), "does not fit this model's KV layout"
        except Exception as exc:  # a file's content: a miss, never an exception reaching the request
            fits, why = False, f"has unusable arrays ({exc!r})"
        if not fits:
            log.warning("prefix cache: disk block %s %s; treated as a miss", key.hex(), why)
            self.disk.discard(key)
            return None
        block = Block(key, bytes.fromhex(header["parent"]), tuple(header["tokens"]), layers)
        self.num_disk_blocks_read += 1
        self.disk_bytes_read += block.nbytes
        self.disk_read_s += time.perf_counter() - t0
        if self.memory.can_hold(block.nbytes):
            self.memory.put(block)
        return block

    def _exact_tq_prefix(self, parts: list, pos: int) -> tuple[list, int]:
        """The parts and length of the TurboQuant prefix to restore: `pos`, or its last
        multiple of `group` when a block lacks the dense K/V of a position in the
        would-be dense tail (a position a cold run at that offset still holds dense
        must not come back decoded; docs/CACHE.md, "TurboQuant blocks")."""
        first_tq = next((i for i in range(len(self._layout)) if i not in self._dense_layers), None)
        if first_tq is None:
            return parts, pos
        floor, start = pos - pos % self.tq.group, 0
        for layers, n in parts:
            if max(start, floor) - start < n and layers[first_tq].dense_from > max(start, floor) - start:
                break
            start += n
        else:
            return parts, pos
        kept, start = [], 0
        for layers, n in parts:
            if floor - start > 0:
                kept.append((layers, min(n, floor - start)))
            start += n
        return kept, floor

    def _fits_layout(self, layers: list, n: int) -> bool:
        """Whether a disk block's layers are this model's, in this cache's format, n positions each."""
        if len(layers) != len(self._layout):
            return False
        for i, (layer, (heads, dim, dtype), (k_dim, v_dim, _)) in enumerate(zip(layers, self._layout, self._dims)):
            if i in self._dense_layers:
                if isinstance(layer, TQLayer):
                    return False
                k, v = layer
                if (tuple(k.shape[:2]), tuple(k.shape[3:]), k.dtype, k.shape[2]) != (heads, dim, dtype, n):
                    return False
                if (tuple(v.shape[:2]), tuple(v.shape[3:]), v.dtype, v.shape[2]) != (heads, (v_dim,), dtype, n):
                    return False
                continue
            if not isinstance(layer, TQLayer):
                return False
            words_k, words_v = get_codec(k_dim, self.tq.bits, self.tq.seed).words, get_codec(v_dim, self.tq.bits, self.tq.seed).words
            shapes = tuple(tuple(a.shape) for a in (layer.k_norms, layer.k_codes, layer.v_norms, layer.v_codes))
            if shapes != ((*heads, n, 1), (*heads, n, words_k), (*heads, n, 1), (*heads, n, words_v)):
                return False
            dk, dv = layer.dense_k, layer.dense_v
            if (dk is None) != (dv is None):
                return False
            if dk is not None:
                m = dk.shape[2]
                if m > n or (tuple(dk.shape), dk.dtype, tuple(dv.shape), dv.dtype) != (
                        (*heads, m, k_dim), dtype, (*heads, m, v_dim), dtype):
                    return False
        return True


def _common(a, b) -> int:
    return len(os.path.commonprefix([list(a), b]))

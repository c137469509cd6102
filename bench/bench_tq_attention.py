"""Decode-step attention of one layer: dense vs TurboQuant, MLX ops vs the CUDA kernels.

Per decode step of one attention layer holding T cached tokens per row, side by side:

* dense: a `KVCache` and MLX's fused SDPA (the floor, rows of equal length);
* TQ MLX ops: the rotated-basis path with stock MLX ops (codebook values of the
  whole cache materialised, then SDPA), what the CPU runs;
* TQ kernel (CUDA): engine/decode_attention.py's split-K kernel over the codes, the default
  variant and then each of them side by side: v3 (v2s's step, session 6's kernel: 8-byte code
  loads per lane by default, `--tq3-load 16` / `4` / `8p` to compare), v2s (deferred encode, in-place dense tail, split and reduce
  kernels), v2 (the same in one launch), v1 (session 4's step);
* dense kernel (CUDA): the dense split-K kernel over equal-length rows;
* with --rows > 1, left-padded rows: MLX's masked SDPA vs the dense kernel;
* --queued: how the engine runs a token (`queued_step_time`): L independent layer caches
  (--layers, default 36, fewer where L dense caches would pass --queued-gb), each layer's step
  queued after the previous one's (its output is the next layer's query) and one eval per
  token, reported as ms per layer (total / L), dense and each TurboQuant variant side by side.
  The default (synced) figure evaluates every single layer step, so at one row it mostly
  times the host's launch latency; both are reported.

Each step includes the cache update (TurboQuant encodes the new token); --parts also
times update and attention apart.

* --kernel-time: the GPU time of one layer step's kernels, read by Nsight Compute (`ncu`): run
  under `ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum
  --log-file K.csv`, the script opens the profiler (cuProfilerStart) only around --kernel-steps
  synced steps of each case (dense: MLX's SDPA + the cache update's copies; TurboQuant: every
  kernel of the step), each case on its own MLX stream, and writes the cases (--json); then
  `--ncu-csv K.csv --kernel-cases cases.json` (no GPU needed) sums each case's kernels per step.
* --sync-floor: the synced time (one eval, as the synced figure) of a chain of n trivial
  launches, n = 1..6, elementwise adds and a trivial custom kernel: the fixed cost a synced step
  of n launches pays before its kernels do any work.

    python bench/bench_tq_attention.py --shape qwen3-8b --context 4096 --context 32768 --context 100000
    python bench/bench_tq_attention.py --shape qwen3-8b --rows 1 --rows 8 --context 32768 --parts
    python bench/bench_tq_attention.py --shape qwen3-8b --context 32768 --rows 1 --queued --variants v3,v4
    python bench/bench_tq_attention.py --model fixtures/tiny-llama     # whole-model decode tok/s
    ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum --log-file k.csv \
        python bench/bench_tq_attention.py --shape qwen3-8b --context 100000 --kernel-time --json cases.json
    python bench/bench_tq_attention.py --ncu-csv k.csv --kernel-cases cases.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.tq_cache import BatchTurboQuantKVCache, TurboQuantKVCache  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen3-8b": (32, 8, 128)}  # query heads, KV heads, head dim


def step_time(cache, mode: str, q_heads: int, kv_heads: int, dim: int, dtype, steps: int, rows: int = 1,
              part: str = "step", first: int = 2, window: bool = False) -> float:
    """Median seconds of one decode step of one layer: `update_and_fetch` of a new token per
    row, then attention ("dense": MLX's SDPA over the returned K/V, with the padding mask
    when rows are padded; "hook": the attention hook's route, which takes
    engine.decode_attention's kernels where `decode_attention.mode()` says so; "decoded":
    SDPA over the cache's decoded K/V). part "update" times the update alone, "attend" the
    attention alone (its update evaluated first). The median leaves out the `first` steps.
    `window`: open ncu's capture window (`profiler`) around each step only, after its inputs exist."""
    from engine.attention_hook import _hooked

    hook = _hooked(lambda q, k, v, cache, scale, mask, sinks=None: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask=mask))
    times = []
    for _ in range(steps):
        k = mx.random.normal((rows, kv_heads, 1, dim)).astype(dtype)
        v = mx.random.normal((rows, kv_heads, 1, dim)).astype(dtype)
        q = mx.random.normal((rows, q_heads, 1, dim)).astype(dtype)
        mask = cache.make_mask(1) if hasattr(cache, "left_padding") else None
        mx.eval(k, v, q, mask) if mask is not None else mx.eval(k, v, q)
        if window:
            profiler(True)
        t0 = time.perf_counter()
        keys, values = cache.update_and_fetch(k, v)
        if part == "update":
            mx.eval(*_cache_arrays(cache))
            times.append(time.perf_counter() - t0)
            continue
        if part == "attend":
            mx.eval(*_cache_arrays(cache))
            t0 = time.perf_counter()
        if mode == "hook":
            out = hook(q, keys, values, cache=cache, scale=dim ** -0.5, mask=mask)
        else:
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=dim ** -0.5, mask=mask)
        mx.eval(out, *_cache_arrays(cache))
        times.append(time.perf_counter() - t0)
        if window:
            profiler(False)
    return statistics.median(times[first:])


def queued_step_time(make, mode: str, layers: int, q_heads: int, kv_heads: int, dim: int, dtype, steps: int,
                     rows: int = 1, host_out: list | None = None) -> float:
    """Median seconds per layer of one "token" as the engine runs it: `layers` caches made by
    `make`, each layer's `update_and_fetch` + attention queued after the previous layer's, whose
    output (B, Hq, 1, D) is the next layer's query (a dependency chain, as through a model's
    layers), and one eval of every output and cache array at the end: no host sync between
    layers, so launches and their Python overlap the GPU's work as in a decode step. `host_out`
    gets the median seconds per layer spent building the graph before the eval (Python and
    MLX's graph, no GPU wait: where it is close to the total, the step waits on the host)."""
    from engine.attention_hook import _hooked

    hook = _hooked(lambda q, k, v, cache, scale, mask, sinks=None: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask=mask))
    caches = []
    for _ in range(layers):
        caches.append(make())
        mx.eval(*_cache_arrays(caches[-1]))
    times, host = [], []
    for _ in range(steps):
        k = mx.random.normal((rows, kv_heads, 1, dim)).astype(dtype)
        v = mx.random.normal((rows, kv_heads, 1, dim)).astype(dtype)
        q = mx.random.normal((rows, q_heads, 1, dim)).astype(dtype)
        mx.eval(k, v, q)
        t0 = time.perf_counter()
        live = []
        for cache in caches:
            keys, values = cache.update_and_fetch(k, v)
            if mode == "hook":
                q = hook(q, keys, values, cache=cache, scale=dim ** -0.5, mask=None)
            else:
                q = mx.fast.scaled_dot_product_attention(q, keys, values, scale=dim ** -0.5, mask=None)
            live += _cache_arrays(cache)
        host.append((time.perf_counter() - t0) / layers)  # building the token's graph: the host's share
        mx.eval(q, *live)
        times.append((time.perf_counter() - t0) / layers)
    del caches
    if host_out is not None:
        host_out.append(statistics.median(host[2:]))
    return statistics.median(times[2:])


def queued_layers(context: int, rows: int, kv_heads: int, dim: int, dtype, wanted: int, budget_gb: float) -> int:
    """Layers of the queued mode: `wanted`, or fewer where that many dense caches (the largest
    kind) would take more than `budget_gb` (36 x 8 rows x 100k of a Qwen3-8B layer is 118 GB)."""
    per_layer = 2 * rows * kv_heads * context * dim * mx.zeros((), dtype).itemsize
    return max(1, min(wanted, int(budget_gb * 1e9 // per_layer)))


def _cache_arrays(cache) -> list:
    if isinstance(cache, (TurboQuantKVCache, BatchTurboQuantKVCache)):
        return cache._live_arrays()  # (not `cache.k`: that would encode what a v2 step deferred)
    return [cache.keys, cache.values]


def _fill(cache, keys, values, chunk: int = 8192):
    for a in range(0, keys.shape[2], chunk):
        cache.update_and_fetch(keys[:, :, a : a + chunk], values[:, :, a : a + chunk])
        mx.eval(*_cache_arrays(cache))
    return cache


def _cache_makers(keys, values, bits: int):
    """(dense, tq): makers of fresh one-layer caches holding `keys` / `values`, a `KVCache` and a
    TurboQuant cache marked for the hook route (as make_tq_cache marks the engine's caches)."""
    from mlx_lm.models.cache import KVCache

    def dense():
        c = KVCache()
        c.update_and_fetch(keys, values)
        return c

    def tq():
        c = _fill(TurboQuantKVCache(kv_bits=bits), keys, values)
        c.hooked = True
        return c

    return dense, tq


def measure(shape: str, context: int, bits: int, dtype, steps: int, rows: int = 1, parts: bool = False,
            only_tq: bool = False, unrolls: tuple = (), variants: tuple | None = None, loads: tuple = (),
            queued: int = 0, queued_gb: float = 40.0, only_queued: bool = False, chunks: tuple = (),
            tq5_us: tuple = (), tq5_nofold: bool = False, tq7_pf0: bool = False) -> dict:
    """One layer's decode step at `rows` rows of `context` tokens: dense (MLX's fused SDPA) and
    TurboQuant through MLX ops and through the kernel; with several rows, also left-padded
    rows (every row but the first 1,000 tokens shorter), dense (masked SDPA vs the kernel).
    `queued` > 0: also the queued per-layer figures (`queued_step_time`) over that many layers.
    `chunks`: also v4 with its split forced to each of these chunks (`forced_chunk`); `tq5_us`: also
    v5 at each of these tiles in flight (`tq5_unroll`); `tq7_pf0`: also v7 with one tile buffer (`tq7_buffers`)."""
    from mlx_lm.models.cache import KVCache

    from engine import decode_attention
    from engine.batch_cache import RowBatchKVCache

    q_heads, kv_heads, dim = SHAPES[shape]
    mx.random.seed(0)
    keys = mx.random.normal((rows, kv_heads, context, dim)).astype(dtype)
    values = mx.random.normal((rows, kv_heads, context, dim)).astype(dtype)
    mx.eval(keys, values)
    row = {"shape": shape, "context": context, "rows": rows, "bits": bits}
    kernel = decode_attention.available()
    saved = decode_attention.mode()

    saved_variant, saved_unroll = decode_attention.tq_variant(), decode_attention.tq_unroll()
    saved_load, saved_nib = decode_attention.tq3_load(), decode_attention.tq3_nibble()

    def timed(name, make, mode, kernel_mode, part="step", variant=saved_variant, unroll=None, load=None, nib=None):
        decode_attention.set_mode(kernel_mode)
        decode_attention.set_tq_variant(variant)
        decode_attention.set_tq_unroll(unroll or saved_unroll)
        decode_attention.set_tq3_load(load or saved_load)
        decode_attention.set_tq3_nibble(saved_nib if nib is None else nib)
        try:
            row[name] = round(1e3 * step_time(make(), mode, q_heads, kv_heads, dim, dtype, steps, rows, part), 4)
        finally:
            decode_attention.set_mode(saved)
            decode_attention.set_tq_variant(saved_variant)
            decode_attention.set_tq_unroll(saved_unroll)
            decode_attention.set_tq3_load(saved_load)
            decode_attention.set_tq3_nibble(saved_nib)

    dense, tq = _cache_makers(keys, values, bits)

    def side_cases():
        """(key, setting, variant) of the side cases the synced and the queued figures both time: v4 at
        forced chunks, v5 unfolded, v5 at other tiles in flight (each setting a fresh context manager)."""
        for c in chunks:
            yield f"v4_chunk{c}", forced_chunk(c), "v4"
        if tq5_nofold:
            yield "v5_nofold", tq5_fold(False), "v5"
        for u in tq5_us:
            yield f"v5_u{u}", tq5_unroll(u), "v5"
        if tq7_pf0:
            yield "v7_pf0", tq7_buffers(False), "v7"

    if not only_queued:
        timed("warmup_dense_ms", dense, "dense", "off")  # discarded: the first timing of a shape ran slow (session 6)
        del row["warmup_dense_ms"]
        timed("dense_ms", dense, "dense", "off")
        if not only_tq:
            timed("tq_mlx_ops_ms", tq, "hook", "off")
            row["tq_mlx_ops_vs_dense"] = round(row["tq_mlx_ops_ms"] / row["dense_ms"], 3)
        if kernel:
            # The default variant (tq_kernel_ms), then every variant side by side (docs/TURBOQUANT.md).
            timed("tq_kernel_ms", tq, "hook", "on")
            for u in unrolls:
                timed(f"tq_kernel_u{u}_ms", tq, "hook", "on", unroll=u)
                row[f"tq_kernel_u{u}_vs_dense"] = round(row[f"tq_kernel_u{u}_ms"] / row["dense_ms"], 3)
            for variant in variants or decode_attention.TQ_VARIANTS:
                timed(f"tq_kernel_{variant}_ms", tq, "hook", "on", variant=variant)
                row[f"tq_kernel_{variant}_vs_dense"] = round(row[f"tq_kernel_{variant}_ms"] / row["dense_ms"], 3)
            for key, setting, variant in side_cases():
                with setting:
                    timed(f"tq_kernel_{key}_ms", tq, "hook", "on", variant=variant)
                row[f"tq_kernel_{key}_vs_dense"] = round(row[f"tq_kernel_{key}_ms"] / row["dense_ms"], 3)
            for spec in loads:  # v3 at other code-load widths ("8": 8 bytes; "8p": shift-and-mask code extraction)
                load, nib = int(str(spec).rstrip("p")), not str(spec).endswith("p")
                timed(f"tq_kernel_v3_l{spec}_ms", tq, "hook", "on", variant="v3", load=load, nib=nib)
                row[f"tq_kernel_v3_l{spec}_vs_dense"] = round(row[f"tq_kernel_v3_l{spec}_ms"] / row["dense_ms"], 3)
            # dense once more at the end: the spread of the baseline inside one row's measurements
            timed("dense_again_ms", dense, "dense", "off")
            if parts:
                timed("tq_update_ms", tq, "hook", "on", "update")
                timed("tq_kernel_attend_ms", tq, "hook", "on", "attend")
                timed("dense_attend_ms", dense, "dense", "off", "attend")
            row["tq_kernel_vs_dense"] = round(row["tq_kernel_ms"] / row["dense_ms"], 3)
    if queued:
        layers = queued_layers(context, rows, kv_heads, dim, dtype, queued, queued_gb)
        row["queued_layers"] = layers

        def qtimed(name, make, mode, kernel_mode, variant=saved_variant):
            decode_attention.set_mode(kernel_mode)
            decode_attention.set_tq_variant(variant)
            try:
                host = []
                row[name] = round(1e3 * queued_step_time(make, mode, layers, q_heads, kv_heads, dim, dtype, steps,
                                                         rows, host), 4)
                row[name.replace("_ms", "_host_ms")] = round(1e3 * host[0], 4)
            finally:
                decode_attention.set_mode(saved)
                decode_attention.set_tq_variant(saved_variant)
                mx.clear_cache()

        qtimed("queued_dense_ms", dense, "dense", "off")
        if kernel:
            for variant in variants or decode_attention.TQ_VARIANTS:
                qtimed(f"queued_tq_{variant}_ms", tq, "hook", "on", variant=variant)
                row[f"queued_tq_{variant}_vs_dense"] = round(row[f"queued_tq_{variant}_ms"] / row["queued_dense_ms"], 3)
            for key, setting, variant in side_cases():
                with setting:
                    qtimed(f"queued_tq_{key}_ms", tq, "hook", "on", variant=variant)
                row[f"queued_tq_{key}_vs_dense"] = round(row[f"queued_tq_{key}_ms"] / row["queued_dense_ms"], 3)
            qtimed("queued_dense_again_ms", dense, "dense", "off")
        else:
            qtimed("queued_tq_mlx_ops_ms", tq, "hook", "off")
            row["queued_tq_mlx_ops_vs_dense"] = round(row["queued_tq_mlx_ops_ms"] / row["queued_dense_ms"], 3)
    if only_tq or only_queued:
        return row
    if rows > 1:
        lengths = [context] + [context - 1000 - 37 * i for i in range(rows - 1)]

        def padded_dense():
            singles = []
            for i, n in enumerate(lengths):
                c = KVCache()
                c.update_and_fetch(keys[i : i + 1, :, :n], values[i : i + 1, :, :n])
                singles.append(c)
            return RowBatchKVCache.merge(singles)

        timed("dense_padded_masked_ms", padded_dense, "dense", "off")
        if kernel:
            timed("dense_padded_kernel_ms", padded_dense, "hook", "on")
            row["dense_padded_kernel_vs_unpadded"] = round(row["dense_padded_kernel_ms"] / row["dense_ms"], 3)
        row["dense_padded_masked_vs_unpadded"] = round(row["dense_padded_masked_ms"] / row["dense_ms"], 3)
    if kernel:
        timed("dense_kernel_ms", dense_batch(keys, values), "hook", "all")
        row["dense_kernel_vs_dense"] = round(row["dense_kernel_ms"] / row["dense_ms"], 3)
    return row


def dense_batch(keys, values):
    """Equal-length rows as a `RowBatchKVCache` (no padding): the dense kernel in mode "all"."""
    from mlx_lm.models.cache import KVCache

    from engine.batch_cache import RowBatchKVCache

    def make():
        singles = []
        for i in range(keys.shape[0]):
            c = KVCache()
            c.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            singles.append(c)
        return RowBatchKVCache.merge(singles)

    return make


def model_decode(model_dir: Path, context: int, tokens: int, bits: int) -> dict:
    """Decode tokens/s of a whole model after a `context`-token prompt: dense cache, TurboQuant
    with the rotated-basis hook, and TurboQuant through the decoded K/V (hook removed)."""
    import importlib

    from mlx_lm.models.cache import make_prompt_cache

    from engine.cpu_runtime import load_model
    from engine.tq_config import make_tq_cache

    model, _ = load_model(model_dir, None)
    prompt = mx.random.randint(10, 1000, (1, context))

    def rate(cache) -> float:
        model(prompt, cache=cache)
        mx.eval([c.state for c in cache])
        token = mx.array([[11]])
        t0 = time.perf_counter()
        for _ in range(tokens):
            token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
            mx.eval(token)
        return tokens / (time.perf_counter() - t0)

    module = importlib.import_module(type(model).__module__)
    row = {"model": model_dir.name, "context": context, "bits": bits}
    make_tq_cache(model, bits=bits)  # installs the hook
    hooked = module.scaled_dot_product_attention
    from mlx_lm.models.base import scaled_dot_product_attention as plain

    runs = {"dense": [], "tq_rotated": [], "tq_decoded": []}
    for _ in range(3):  # interleaved, medians: the machine is shared
        runs["dense"].append(rate(make_prompt_cache(model)))
        runs["tq_rotated"].append(rate(make_tq_cache(model, bits=bits)))
        module.scaled_dot_product_attention = plain
        try:
            runs["tq_decoded"].append(rate(_unhooked_cache(model, bits)))
        finally:
            module.scaled_dot_product_attention = hooked
    for name, values in runs.items():
        row[f"{name}_tok_s"] = statistics.median(values)
    row["tq_rotated_vs_dense"] = round(row["tq_rotated_tok_s"] / row["dense_tok_s"], 3)
    row["tq_decoded_vs_dense"] = round(row["tq_decoded_tok_s"] / row["dense_tok_s"], 3)
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}


def _unhooked_cache(model, bits: int) -> list:
    from mlx_lm.models.cache import KVCache

    n = len(model.layers)
    return [KVCache() if i == n - 1 else TurboQuantKVCache(kv_bits=bits) for i in range(n)]


# --- kernel time (Nsight Compute) and the sync floor -------------------------------------------

def profiler(on: bool) -> bool:
    """Open / close Nsight Compute's capture window (`ncu --profile-from-start off`): the driver's
    cuProfilerStart / Stop on the current context, else the runtime's. False where neither
    answered (no CUDA, or no profiler attached: then the calls are no-ops and nothing is lost)."""
    import ctypes

    for lib, fn in (("libcuda.so.1", "cuProfilerStart" if on else "cuProfilerStop"),
                    ("libcudart.so.13", "cudaProfilerStart" if on else "cudaProfilerStop"),
                    ("libcudart.so.12", "cudaProfilerStart" if on else "cudaProfilerStop")):
        try:
            if getattr(ctypes.CDLL(lib), fn)() == 0:
                return True
        except (OSError, AttributeError):
            continue
    return False


def kernel_cases(shape: str, context: int, bits: int, dtype, rows: int, variants: tuple, steps: int,
                 chunks: tuple = (), tq5_us: tuple = (), tq5_nofold: bool = False, tq7_pf0: bool = False) -> list[dict]:
    """Each case (dense, then each TurboQuant variant, then v4 at each forced split chunk in
    `chunks`, then v5 at each tiles-in-flight count of `tq5_us`): warm-up steps outside the capture window, then `steps` synced steps inside it, on
    a stream of the case's own; the capture window opens around each step only, after its inputs
    are made (`step_time`'s `window`), so ncu sees the step's kernels alone."""
    from engine import decode_attention

    q_heads, kv_heads, dim = SHAPES[shape]
    mx.random.seed(0)
    keys = mx.random.normal((rows, kv_heads, context, dim)).astype(dtype)
    values = mx.random.normal((rows, kv_heads, context, dim)).astype(dtype)
    mx.eval(keys, values)
    saved_mode, saved_variant = decode_attention.mode(), decode_attention.tq_variant()
    out = []

    dense, tq = _cache_makers(keys, values, bits)

    plan = [("dense", dense, "dense", "off", saved_variant, None)]
    plan += [(v, tq, "hook", "on", v, None) for v in variants]
    plan += [(f"v4_chunk{c}", tq, "hook", "on", "v4", c) for c in chunks]
    plan += [(f"v5_u{u}", tq, "hook", "on", "v5", -u) for u in tq5_us]  # (a negative "chunk": v5's U)
    plan += [("v5_nofold", tq, "hook", "on", "v5", 0)] if tq5_nofold else []  # (chunk 0: v5 with the fold off)
    plan += [("v7_pf0", tq, "hook", "on", "v7", "pf0")] if tq7_pf0 else []  # ("pf0": v7 with one tile buffer)
    for name, make, mode, kernel_mode, variant, chunk in plan:
        pf0, chunk = chunk == "pf0", None if chunk == "pf0" else chunk
        decode_attention.set_mode(kernel_mode)
        decode_attention.set_tq_variant(variant)
        try:
            with forced_chunk(chunk if chunk and chunk > 0 else None), tq5_unroll(-chunk if chunk and chunk < 0 else None), \
                    tq5_fold(False if chunk == 0 else None), tq7_buffers(False if pf0 else None):
                cache = make()
                step_time(cache, mode, q_heads, kv_heads, dim, dtype, 3, rows)  # builds the kernels
                stream = mx.new_stream(mx.default_device())
                with mx.stream(stream):
                    step_time(cache, mode, q_heads, kv_heads, dim, dtype, 3, rows)
                    opened = profiler(True)
                    profiler(False)
                    step_time(cache, mode, q_heads, kv_heads, dim, dtype, steps, rows, first=0, window=True)
        finally:
            decode_attention.set_mode(saved_mode)
            decode_attention.set_tq_variant(saved_variant)
        out.append({"case": name, "shape": shape, "context": context, "rows": rows, "steps": steps,
                    "stream": str(stream), "profiler": opened, **({"chunk": chunk} if chunk and chunk > 0 else {})})
        print(json.dumps(out[-1]), flush=True)
        del cache
        mx.clear_cache()
    return out


class forced_chunk:
    """Within the block, TurboQuant decode steps split the context into `chunk` columns per block
    (at least the dense window's) instead of `split_chunk`'s choice: wave quantisation, measured
    without a new variant. None: no change."""

    def __init__(self, chunk: int | None):
        self.chunk = chunk

    def __enter__(self):
        from engine import decode_attention

        self.saved = decode_attention.split_chunk
        if self.chunk:
            chunk, saved = self.chunk, self.saved
            decode_attention.split_chunk = lambda tokens, kv_heads, rows, g, at_least=0, target=0: (
                max(chunk, saved(tokens, kv_heads, rows, g, at_least)) if at_least > chunk else chunk)
        return self

    def __exit__(self, *exc):
        from engine import decode_attention

        decode_attention.split_chunk = self.saved


class tq5_fold:
    """Within the block, v5 folds its reduce (True) or never does (False). None: no change."""

    def __init__(self, on: bool | None):
        self.on = on

    def __enter__(self):
        from engine import tq_mma

        self.saved = tq_mma.fold5()
        if self.on is not None:
            tq_mma.set_fold5(self.on)
        return self

    def __exit__(self, *exc):
        from engine import tq_mma

        tq_mma.set_fold5(self.saved)


class tq7_buffers:
    """Within the block, v7 warps keep the next tile in flight (True: two tile buffers) or not (False:
    one; `tq_fused.set_tq7_prefetch`). None: no change."""

    def __init__(self, on: bool | None):
        self.on = on

    def __enter__(self):
        from engine import tq_fused

        self.saved = tq_fused.tq7_prefetch()
        if self.on is not None:
            tq_fused.set_tq7_prefetch(int(self.on))
        return self

    def __exit__(self, *exc):
        from engine import tq_fused

        tq_fused.set_tq7_prefetch(int(self.saved))


class tq5_unroll:
    """Within the block, v5 warps keep `u` tiles in flight (`tq_mma.set_tq5_unroll`). None: no change."""

    def __init__(self, u: int | None):
        self.u = u

    def __enter__(self):
        from engine import tq_mma

        self.saved = tq_mma.tq5_unroll()
        if self.u:
            tq_mma.set_tq5_unroll(self.u)
        return self

    def __exit__(self, *exc):
        from engine import tq_mma

        tq_mma.set_tq5_unroll(self.saved)


_NCU_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}


def parse_ncu_csv(text: str, metric: str = "gpu__time_duration.sum") -> list[dict]:
    """Nsight Compute's `--csv` output (its details page: one line per kernel and metric) ->
    [{"id", "kernel", "stream", "grid", "block", "us"}] in launch order. Lines before the header
    (ncu's own messages, "==PROF==") are skipped; values may carry thousands separators."""
    import csv
    import io

    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    rows = []
    for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if r.get("Metric Name") != metric:
            continue
        unit = _NCU_UNITS.get((r.get("Metric Unit") or "nsecond").strip(), 1e-3)
        rows.append({"id": int(r["ID"]), "kernel": r.get("Kernel Name", ""), "stream": r.get("Stream", ""),
                     "grid": r.get("Grid Size", ""), "block": r.get("Block Size", ""),
                     "us": float(r["Metric Value"].replace(",", "")) * unit})
    return sorted(rows, key=lambda r: r["id"])


# Kernels that only make a step's inputs (mx.random.normal, astype): a window opened before the
# inputs existed (session 8's run) caught them; they are not the step's.
_INPUT_KERNELS = ("rbitsc", "ErfInv", "binary_vs<mlx::Divide, float", "binary_vs<mlx::Minimum, float",
                  "binary_ss<mlx::Subtract, float", "binary_sv<mlx::Multiply, float", "binary_vs<mlx::Add, float",
                  "copy_v<unsigned int, float", "copy_v<float, __nv_bfloat16")


def _kernel_kind(name: str) -> str:
    if any(k in name for k in _INPUT_KERNELS):
        return "input"
    for key, kind in (("tq4", "tq_split"), ("tq5", "tq_split"), ("tq7", "tq_split"), ("tq3_reduce", "tq_reduce"), ("decode_tq3", "tq_split"),
                      ("encode", "tq_encode"), ("sdpa", "sdpa"), ("lean_reduction", "sdpa"), ("copy", "copy"),
                      ("slice", "copy"), ("fill", "fill")):
        if key in name.lower():
            return kind
    return "other"


def kernel_summary(kernels: list[dict], cases: list[dict]) -> list[dict]:
    """Per case: the kernels ncu timed in its steps, per step (their sum, their count, and by kind:
    split / reduce / encode / SDPA / copies). A step starts where a cache-update copy follows a
    kernel of the previous step's attention (every step starts with its K and V writes); steps go
    to the cases in order, `steps` each. (Not by ncu's "Stream" column: MLX runs one stream's
    kernels on several CUDA streams.) Input-making kernels are left out."""
    steps: list[list[dict]] = []
    prev = None
    for k in kernels:
        kind = _kernel_kind(k["kernel"])
        if kind == "input":
            continue
        if not steps or (kind == "copy" and prev not in ("copy", "tq_encode", "fill")):
            steps.append([])
        steps[-1].append({**k, "kind": kind})
        prev = kind
    out = []
    for case in cases:
        n = max(1, case["steps"])
        mine, steps = steps[:n], steps[n:]
        flat = [k for st in mine for k in st]
        kinds: dict[str, float] = {}
        for k in flat:
            kinds[k["kind"]] = kinds.get(k["kind"], 0.0) + k["us"] / n
        per_step = sorted(sum(k["us"] for k in st) for st in mine)
        out.append({**{k: case[k] for k in ("case", "context", "rows") if k in case},
                    "kernel_us_per_step": round(sum(per_step) / n, 2),
                    "kernel_us_median_step": round(per_step[len(per_step) // 2], 2) if per_step else 0.0,
                    "launches_per_step": round(len(flat) / n, 2),
                    **{f"{kind}_us": round(v, 2) for kind, v in sorted(kinds.items())},
                    "kernels": sorted({k["kernel"][:80] for k in flat})})
    return out


# What binds a kernel, from ncu's raw page (`ncu -i R.ncu-rep --csv --page raw`): time, DRAM
# throughput, occupancy, shared-memory bank conflicts and the warp stall reasons (cycles per issued
# instruction; the largest say what a warp waits on).
COUNTERS = {
    "us": "gpu__time_duration.sum",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_bytes": "dram__bytes_read.sum",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "regs": "launch__registers_per_thread",
    "smem_ld_wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "smem_ld_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "issue_active_pct": "sm__inst_issued.avg.pct_of_peak_sustained_active",
}
_STALL = "smsp__average_warps_issue_stalled_"


def ncu_counters(text: str) -> list[dict]:
    """Per kernel of ncu's raw CSV page: `COUNTERS` and the warp stall reasons (`stall_*`, issue
    cycles per instruction, the six largest)."""
    import csv
    import io

    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    head, body = rows[0], [r for r in rows[1:] if r and r[0].isdigit()]
    units = dict(zip(head, rows[1])) if len(rows) > 1 and not (rows[1] and rows[1][0].isdigit()) else {}
    out = []
    for r in body:
        m = dict(zip(head, r))

        def num(name):
            try:
                return float(m.get(name, "").replace(",", ""))
            except ValueError:
                return None
        row = {"id": int(m["ID"]), "kernel": m.get("Kernel Name", "")[:80], "grid": m.get("Grid Size", "")}
        row.update({k: num(v) for k, v in COUNTERS.items()})
        if row["us"] is not None:  # (the raw page's second line holds the units)
            row["us"] *= _NCU_UNITS.get(units.get(COUNTERS["us"], "nsecond").strip(), 1e-3)
        stalls = {k[len(_STALL):].replace("_per_issue_active.ratio", ""): num(k) for k in head
                  if k.startswith(_STALL) and k.endswith("_per_issue_active.ratio") and "not_issued" not in k}
        top = sorted(((v, k) for k, v in stalls.items() if v), reverse=True)[:6]
        row.update({f"stall_{k}": round(v, 2) for v, k in top})
        out.append(row)
    return out


def sync_floor(launches: int, steps: int, kind: str = "add") -> float:
    """Median seconds of one synced eval of a chain of `launches` trivial kernels on a 256-float
    array: "add" (MLX elementwise adds) or "custom" (a trivial `mx.fast.cuda_kernel`, the kind of
    launch the TurboQuant step makes)."""
    x = mx.zeros((256,), mx.float32)
    mx.eval(x)
    if kind == "custom":
        k = mx.fast.cuda_kernel(name="prefixtrace_sync_floor", input_names=["a"], output_names=["o"],
                                source="const int i = threadIdx.x; o[i] = a[i] + 1.f;")

        def op(a):
            return k(inputs=[a], grid=(256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(256,)],
                     output_dtypes=[mx.float32])[0]
    else:
        def op(a):
            return a + 1.0
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        y = x
        for _ in range(launches):
            y = op(y)
        mx.eval(y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def sync_floors(steps: int, top: int = 6) -> dict:
    """`sync_floor` for 1..`top` launches of each kind ("custom" on CUDA only)."""
    from engine import decode_attention

    kinds = ("add", "custom") if decode_attention.available() else ("add",)
    return {f"sync_floor_{kind}_{n}_ms": round(1e3 * sync_floor(n, steps, kind), 4)
            for kind in kinds for n in range(1, top + 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), action="append")
    ap.add_argument("--context", type=int, action="append")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--dtype", default="float32" if mx.default_device() == mx.cpu else "bfloat16")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--model", type=Path, help="also time whole-model decode on this mlx-lm directory")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rows", type=int, action="append", help="rows per step (default 1; repeat: --rows 1 --rows 8)")
    ap.add_argument("--parts", action="store_true", help="also time the update and the attention apart")
    ap.add_argument("--unroll", type=int, action="append", default=[],
                    help="also time the default variant with this tq_unroll (repeat: --unroll 8 --unroll 16)")
    ap.add_argument("--variants", help="TurboQuant kernel variants timed side by side (default: all), e.g. v2s,v3")
    ap.add_argument("--tq3-load", action="append", default=[],
                    help="also time v3 with this many code bytes per lane load, suffix p: without the byte-permute "
                    "code extraction (repeat: --tq3-load 16 --tq3-load 8p)")
    ap.add_argument("--only-tq", action="store_true",
                    help="dense and the TurboQuant kernels only (no MLX-ops path, no padded rows)")
    ap.add_argument("--queued", action="store_true",
                    help="also time L layers queued per token, one eval at the end (ms per layer: total / L)")
    ap.add_argument("--layers", type=int, default=36, help="layers of --queued (default 36, Qwen3-8B's)")
    ap.add_argument("--queued-gb", type=float, default=40.0,
                    help="fewer --queued layers where that many dense caches would take more (GB)")
    ap.add_argument("--only-queued", action="store_true", help="with --queued: leave out the synced figures")
    ap.add_argument("--chunks", default="", help="also v4 with its split forced to these chunks, e.g. 512,768")
    ap.add_argument("--tq5-u", default="", help="also v5 with these tiles in flight per warp, e.g. 4")
    ap.add_argument("--tq5-nofold", action="store_true", help="also v5 with its reduce never folded")
    ap.add_argument("--tq7-pf0", action="store_true", help="also v7 with one tile buffer (no tile in flight across its math)")
    ap.add_argument("--kernel-time", action="store_true",
                    help="run the cases inside ncu's capture window (run under ncu --profile-from-start off)")
    ap.add_argument("--kernel-steps", type=int, default=3, help="synced steps per case inside the window")
    ap.add_argument("--kernel-variants", default="v4", help="TurboQuant variants of --kernel-time")
    ap.add_argument("--ncu-csv", type=Path, help="summarise this ncu CSV per case (with --kernel-cases)")
    ap.add_argument("--kernel-cases", type=Path, help="the --kernel-time run's --json")
    ap.add_argument("--ncu-raw", type=Path, help="print what binds each kernel of this ncu raw CSV page")
    ap.add_argument("--sync-floor", action="store_true", help="also the sync floor of 1..6 trivial launches")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    chunks = tuple(int(c) for c in args.chunks.split(",") if c)
    tq5_us = tuple(int(u) for u in args.tq5_u.split(",") if u)
    if args.ncu_raw:
        for row in ncu_counters(args.ncu_raw.read_text()):
            print(json.dumps(row))
        return
    if args.ncu_csv:
        cases = [c for c in json.loads(args.kernel_cases.read_text()) if "case" in c]
        summary = kernel_summary(parse_ncu_csv(args.ncu_csv.read_text()), cases)
        for row in summary:
            print(json.dumps(row))
        if args.json:
            args.json.write_text(json.dumps(summary, indent=1))
        return
    if args.kernel_time:
        out = [{"device": str(mx.default_device()), "dtype": args.dtype}]
        for shape in args.shape or ["qwen3-8b"]:
            for rows in args.rows or [1]:
                for context in args.context or (32768,):
                    out += kernel_cases(shape, context, args.bits, dtype, rows,
                                        tuple(v for v in args.kernel_variants.split(",") if v), args.kernel_steps,
                                        chunks, tq5_us, args.tq5_nofold, args.tq7_pf0)
                    if args.json:
                        args.json.write_text(json.dumps(out, indent=1))
        return
    if args.model:
        for context in args.context or (1024, 4096):
            print(json.dumps(model_decode(args.model, context, args.tokens, args.bits)))
        return
    out = [{"device": str(mx.default_device()), "dtype": args.dtype}]
    if args.sync_floor:
        out[0].update(sync_floors(args.steps * 4))
    print(json.dumps(out[0]), flush=True)
    for shape in args.shape or list(SHAPES):
        for rows in args.rows or [1]:
            for context in args.context or (1024, 4096, 16384):
                out.append(measure(shape, context, args.bits, dtype, args.steps, rows, args.parts, args.only_tq,
                                   tuple(args.unroll), tuple(args.variants.split(",")) if args.variants else None,
                                   tuple(args.tq3_load), args.layers if args.queued else 0, args.queued_gb,
                                   args.only_queued, chunks, tq5_us, args.tq5_nofold, args.tq7_pf0))
                print(json.dumps(out[-1]), flush=True)
                if args.json:  # as it goes: a run stopped at its limit keeps what it measured
                    args.json.write_text(json.dumps(out, indent=1))
                mx.clear_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""One decode step of one attention layer, dense against TurboQuant, through the production kernels.

Per layer holding T cached tokens per row (Qwen3-8B's layer shape by default), side by side in one run:

* dense: a `KVCache` and MLX's fused SDPA (the floor: rows of equal length);
* turboquant: a TurboQuant cache (4-bit codes) attending through the attention hook, i.e. the table
  `engine.kernels.selector.select()` returns: on CUDA the kernel engine/kernels/tq_decode.py picks
  for the shape (the fused one at head 64 / 128), on the CPU the MLX-ops path.

Each step includes the cache update (TurboQuant encodes or defers the new token); the synced figure
evaluates every step and is reported as ms per layer step with its ratio to dense. With
`--kernel-time` the script opens Nsight Compute's capture window (cuProfilerStart) around each step
only, so that

    ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum --log-file k.csv \\
        python3 bench/bench_decode_kernels.py --context 32768 --context 100000 --rows 1 --rows 8 --kernel-time \\
        --json cases.json
    python3 bench/bench_decode_kernels.py --ncu-csv k.csv --kernel-cases cases.json

gives the GPU time of each case's kernels per step (docs/PERFORMANCE.md, "Decode kernels"; the second
command needs no GPU). Examples:

    python3 bench/bench_decode_kernels.py --context 32768 --context 100000 --rows 1 --rows 8     # H200
    python bench/bench_decode_kernels.py --shape smollm2-135m --context 2048 --dtype float32     # CPU
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

from mlx_lm.models.cache import KVCache  # noqa: E402

from engine.attention_hook import _hooked  # noqa: E402
from engine.kernels import common, selector  # noqa: E402
from engine.tq_cache import BatchTurboQuantKVCache, TurboQuantKVCache  # noqa: E402

SHAPES = {"smollm2-135m": (9, 3, 64), "qwen3-8b": (32, 8, 128)}  # query heads, KV heads, head dim


def profiler(on: bool) -> bool:
    """Open / close Nsight Compute's capture window (`ncu --profile-from-start off`): the driver's
    cuProfilerStart / Stop, else the runtime's. False where neither answered (no CUDA, or no profiler
    attached: then the calls are no-ops)."""
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


def _cache_arrays(cache) -> list:
    if isinstance(cache, (TurboQuantKVCache, BatchTurboQuantKVCache)):
        return cache._live_arrays()  # (not `cache.k`: that would encode what a step deferred)
    return [cache.keys, cache.values]


def make_caches(keys: mx.array, values: mx.array, bits: int):
    """(dense, turboquant): one-layer caches holding `keys` / `values` (rows of equal length), the
    TurboQuant one marked for the hook route as the engine's caches are."""
    dense = KVCache()
    dense.update_and_fetch(keys, values)
    tq = TurboQuantKVCache(kv_bits=bits)
    for a in range(0, keys.shape[2], 8192):
        tq.update_and_fetch(keys[:, :, a : a + 8192], values[:, :, a : a + 8192])
        mx.eval(*_cache_arrays(tq))
    tq.hooked = True
    mx.eval(*_cache_arrays(dense))
    return dense, tq


def step_time(cache, hooked: bool, q_heads: int, kv_heads: int, dim: int, dtype, steps: int, rows: int,
              first: int = 2, window: bool = False) -> float:
    """Median seconds of one synced decode step of one layer (update, attention, eval), leaving out
    the `first` steps. `window`: ncu's capture window around each step only, after its inputs exist."""
    attend = _hooked(lambda q, k, v, cache, scale, mask, sinks=None: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask=mask))
    times = []
    for _ in range(steps):
        k = mx.random.normal((rows, kv_heads, 1, dim)).astype(dtype)
        v = mx.random.normal((rows, kv_heads, 1, dim)).astype(dtype)
        q = mx.random.normal((rows, q_heads, 1, dim)).astype(dtype)
        mx.eval(k, v, q)
        if window:
            profiler(True)
        t0 = time.perf_counter()
        keys, values = cache.update_and_fetch(k, v)
        if hooked:
            out = attend(q, keys, values, cache=cache, scale=dim ** -0.5, mask=None)
        else:
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=dim ** -0.5)
        mx.eval(out, *_cache_arrays(cache))
        times.append(time.perf_counter() - t0)
        if window:
            profiler(False)
    return statistics.median(times[first:])


def measure(shape: str, context: int, rows: int, bits: int, dtype, steps: int, kernel_time: bool) -> tuple:
    """The synced figures of one (context, rows), and the capture cases when `kernel_time`."""
    q_heads, kv_heads, dim = SHAPES[shape]
    mx.random.seed(0)
    keys = mx.random.normal((rows, kv_heads, context, dim)).astype(dtype)
    values = mx.random.normal((rows, kv_heads, context, dim)).astype(dtype)
    mx.eval(keys, values)
    dense, tq = make_caches(keys, values, bits)
    del keys, values
    before = dict(common.launches)
    row = {"shape": shape, "context": context, "rows": rows, "bits": bits, "dtype": str(dtype), "steps": steps}
    cases = []
    for name, cache, hooked in (("dense", dense, False), ("turboquant", tq, True)):
        step_time(cache, hooked, q_heads, kv_heads, dim, dtype, 3, rows)  # builds the kernels
        row[f"{name}_ms"] = round(1e3 * step_time(cache, hooked, q_heads, kv_heads, dim, dtype, steps, rows), 4)
        if kernel_time:
            stream = mx.new_stream(mx.default_device())
            with mx.stream(stream):
                step_time(cache, hooked, q_heads, kv_heads, dim, dtype, 3, rows)
                opened = profiler(True)
                profiler(False)
                step_time(cache, hooked, q_heads, kv_heads, dim, dtype, 3, rows, first=0, window=True)
            cases.append({"case": name, "context": context, "rows": rows, "steps": 3, "profiler": opened})
    row["turboquant_vs_dense"] = round(row["turboquant_ms"] / row["dense_ms"], 3)
    row["kernels_ran"] = {k: v - before.get(k, 0) for k, v in common.launches.items() if v - before.get(k, 0)}
    return row, cases


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
# inputs existed caught them; they are not the step's.
_INPUT_KERNELS = ("rbitsc", "ErfInv", "binary_vs<mlx::Divide, float", "binary_vs<mlx::Minimum, float",
                  "binary_ss<mlx::Subtract, float", "binary_sv<mlx::Multiply, float", "binary_vs<mlx::Add, float",
                  "copy_v<unsigned int, float", "copy_v<float, __nv_bfloat16")


def _kernel_kind(name: str) -> str:
    if any(k in name for k in _INPUT_KERNELS):
        return "input"
    for key, kind in (("tq3_reduce", "tq_reduce"), ("decode_tq", "tq_split"),
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="qwen3-8b")
    ap.add_argument("--context", type=int, action="append")
    ap.add_argument("--rows", type=int, action="append", help="rows per step (default 1; repeat: --rows 1 --rows 8)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--dtype", default="float32" if mx.default_device() == mx.cpu else "bfloat16")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kernel-time", action="store_true", help="open ncu's capture window around 3 steps per case")
    ap.add_argument("--ncu-csv", type=Path, help="summarise this ncu CSV per case (with --kernel-cases; no GPU)")
    ap.add_argument("--kernel-cases", type=Path, help="the --kernel-time run's --json")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    if args.ncu_csv:
        cases = json.loads(args.kernel_cases.read_text())["cases"]
        out = {"kernels": kernel_summary(parse_ncu_csv(args.ncu_csv.read_text()), cases)}
        for r in out["kernels"]:
            print(json.dumps({k: v for k, v in r.items() if k != "kernels"}))
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        return
    dtype = getattr(mx, args.dtype)
    out = {"device": str(mx.default_device()), "kernels": type(selector.select()).__name__, "runs": [], "cases": []}
    for context in args.context or [4096]:
        for rows in args.rows or [1]:
            row, cases = measure(args.shape, context, rows, args.bits, dtype, args.steps, args.kernel_time)
            out["runs"].append(row)
            out["cases"] += cases
            print(json.dumps(row), flush=True)
            mx.clear_cache()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

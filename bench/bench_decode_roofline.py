"""Decode against the hardware's limit (issue 35): every figure from several processes, with its spread.

    python3 bench/bench_decode_roofline.py --json roofline.json        # H200: random Qwen3-8B bf16, 3 processes
    python3 bench/bench_decode_roofline.py --shape small --contexts 1024 --tokens 8 --tq-tokens 4 --processes 2

The parent spawns --processes children one after another (each builds the model itself: a swing between
processes shows only between processes) and prints, per figure, each process's reading, the median and
the spread (max / min), then the issue's targets checked in every process. Each child measures:

1. bytes: what one decode step must read, counted from the model's weights (every matrix once, one row of
   the embedding) plus the KV cache at the context; the roofline tok/s = bandwidth / those bytes, for the
   H200's stated 4.8 TB/s and for what a plain big copy and a plain big read measure here.
2. weights: MLX's own read of every weight matrix with one row of x (`x @ w.T`, the decode projections),
   summed over the model and per matrix kind, against engine/kernels/gemv.py's GEMV on the same weights
   (and its error); in the first process also each (RW, SPLIT) plan of the GEMV per shape.
3. host: one decode step of the bare model, the host's graph-building time against the whole step.
4. decode: engine B = 1 and B = 8 (decode phase) with MLX's one-row matmul and with the GEMV; the plain
   mlx-lm loop and mlx-lm's `GenerationBatch` on the model before the engine swapped its projections.
5. turboquant: one row through the engine, dense and TurboQuant KV, at each --contexts (served twice each),
   with what could tell apart the causes of TurboQuant's swing between processes: the decode kernels that
   ran (engine/kernels/common.py `launches`), their build times at load, MLX's memory pool before the run,
   the GPU's clocks / power / temperature around it, the per-token step times (uniformly slower, or stalls),
   and the host CPU time per decode second.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

STATED_BANDWIDTH = 4.8e12  # the H200's HBM3e, as NVIDIA states it
SHAPES = ("qwen3-8b", "small")


# ---------------------------------------------------------------------------------------------- child



def _gemv_env(on: bool | None) -> None:
    """PREFIXTRACE_GEMV for what follows in this process (None: as the process started)."""
    if on is None:
        if _GEMV_AT_START is None:
            os.environ.pop("PREFIXTRACE_GEMV", None)
        else:
            os.environ["PREFIXTRACE_GEMV"] = _GEMV_AT_START
    else:
        os.environ["PREFIXTRACE_GEMV"] = "1" if on else "0"


_GEMV_AT_START = os.environ.get("PREFIXTRACE_GEMV")

def timed(fn, repeats: int) -> list[float]:
    """Seconds of `fn()` (which returns arrays to evaluate), synced, after one warm-up call."""
    mx.eval(fn())
    mx.synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def gpu_state() -> dict:
    """Clocks, power and temperature from nvidia-smi (empty where there is none)."""
    out = {}
    # the throttle reasons asked apart: a driver that names the field otherwise still gives the clocks
    for fields in ("clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu", "clocks_throttle_reasons.active"):
        try:
            run = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return out
        values = [v.strip() for v in run.stdout.strip().split(",")]
        if run.returncode == 0 and len(values) == len(fields.split(",")):
            out.update(zip(fields.split(","), values))
    return out


def pool_state() -> dict:
    return {"active_gb": round(mx.get_active_memory() / 1e9, 2), "cache_gb": round(mx.get_cache_memory() / 1e9, 2),
            "peak_gb": round(mx.get_peak_memory() / 1e9, 2)}


def build(shape: str):
    from bench.bench_scheduler import QWEN3_8B, random_loader
    from bench.bench_turboquant import SMALL_QWEN3

    config = QWEN3_8B if shape == "qwen3-8b" else SMALL_QWEN3
    mx.random.seed(0)
    model, tokenizer, cfg = random_loader(config, mx.bfloat16 if shape == "qwen3-8b" else mx.float32)()
    return model, tokenizer, cfg


def matrices(model) -> list[tuple[str, mx.array]]:
    """Every 2-D weight a decode step multiplies, by kind (q_proj, ..., lm_head)."""
    from mlx.utils import tree_flatten

    return [(name.split(".")[-2], w) for name, w in tree_flatten(model.parameters())
            if w.ndim == 2 and "embed_tokens" not in name]


def section_bytes(model, cfg, contexts: list[int], tokens: int, bandwidths: dict) -> dict:
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    embed = next(w for name, w in params if "embed_tokens" in name)
    weight_bytes = sum(w.nbytes for _, w in params) - embed.nbytes + embed.nbytes // embed.shape[0]
    itemsize = embed.dtype.size
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * itemsize
    short = 16 + tokens // 2  # the decode figures' mean context
    out = {"weight_bytes_per_step": weight_bytes, "kv_bytes_per_token": kv_per_token, "short_context": short,
           "step_bytes": {str(c): weight_bytes + kv_per_token * c for c in [short, *contexts]}}
    out["roofline_tok_s"] = {name: {c: round(bw / b, 1) for c, b in out["step_bytes"].items()}
                             for name, bw in bandwidths.items()}
    return out


def section_bandwidth(gib: float) -> dict:
    """A plain big copy (read + write) and a plain big read (a sum), best and median of 5."""
    n = int(gib * 2**30) // 4
    a = mx.random.uniform(shape=(n,))
    mx.eval(a)
    copy = timed(lambda: a + 1.0, 5)
    read = timed(lambda: a.sum(), 5)
    out = {"copy_bytes": 2 * a.nbytes, "copy_tb_s_best": round(2 * a.nbytes / min(copy) / 1e12, 3),
           "copy_tb_s_median": round(2 * a.nbytes / statistics.median(copy) / 1e12, 3),
           "read_tb_s_best": round(a.nbytes / min(read) / 1e12, 3),
           "read_tb_s_median": round(a.nbytes / statistics.median(read) / 1e12, 3)}
    del a
    mx.clear_cache()
    return out


def section_weights(model, plans: bool) -> dict:
    """MLX's one-row matmul against the GEMV, reading every weight matrix of the model."""
    from engine.kernels import gemv

    mats = matrices(model)
    xs = {}
    for _, w in mats:
        k = w.shape[1]
        if k not in xs:
            xs[k] = mx.random.normal((1, k)).astype(w.dtype)
    total = sum(w.nbytes for _, w in mats)
    out = {"matrices": len(mats), "bytes": total}
    t = timed(lambda: [xs[w.shape[1]] @ w.T for _, w in mats], 5)
    out["mlx_sum_tb_s"] = round(total / statistics.median(t) / 1e12, 3)
    kinds: dict[str, list[mx.array]] = {}
    for kind, w in mats:
        kinds.setdefault(kind, []).append(w)
    out["mlx_by_kind_tb_s"] = {kind: round(sum(w.nbytes for w in ws) / statistics.median(
        timed(lambda ws=ws: [xs[w.shape[1]] @ w.T for w in ws], 3)) / 1e12, 3) for kind, ws in kinds.items()}
    ok = [(kind, w) for kind, w in mats if gemv.usable(*w.shape, w.dtype)]
    if not ok:
        out["gemv"] = "not run: no CUDA device, or no matrix the GEMV takes"
        return out
    try:  # a GEMV that fails to build or run costs its own figures, not the rest of the process's
        _gemv_figures(out, mats, ok, kinds, xs, plans)
    except Exception as exc:  # noqa: BLE001
        out["gemv"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    return out


def _gemv_figures(out, mats, ok, kinds, xs, plans) -> None:
    from engine.kernels import gemv

    ours = sum(w.nbytes for _, w in ok)
    t = timed(lambda: [gemv.gemv(xs[w.shape[1]], w) for _, w in ok], 5)
    t_mlx = timed(lambda: [xs[w.shape[1]] @ w.T for _, w in ok], 5)
    out["gemv_sum_tb_s"] = round(ours / statistics.median(t) / 1e12, 3)
    out["gemv_vs_mlx_same_matrices"] = round(statistics.median(t_mlx) / statistics.median(t), 3)
    out["gemv_by_kind_tb_s"] = {kind: round(sum(w.nbytes for w in ws) / statistics.median(
        timed(lambda ws=ws: [gemv.gemv(xs[w.shape[1]], w) for w in ws], 3)) / 1e12, 3)
        for kind, ws in kinds.items() if gemv.usable(*ws[0].shape, ws[0].dtype)}
    errs = {}
    for kind, ws in kinds.items():
        w = ws[0]
        if gemv.usable(*w.shape, w.dtype):
            want = (xs[w.shape[1]].astype(mx.float32) @ w.astype(mx.float32).T)
            got = gemv.gemv(xs[w.shape[1]], w).astype(mx.float32)
            errs[kind] = round((mx.abs(got - want).max() / mx.abs(want).max()).item(), 5)
    out["gemv_error_of_scale"] = errs
    out["gemv_ok"] = all(e < 2e-2 for e in errs.values())
    if plans:
        sweep = {}
        for kind, ws in kinds.items():
            n, k = ws[0].shape
            if not gemv.fits(n, k, ws[0].dtype):
                continue
            row = {}
            for rw in (2, 4):
                for split in (1, 2, 4, 8):
                    if k % (256 * split) or n % (gemv.WARPS // split * rw):
                        continue
                    tt = timed(lambda ws=ws, rw=rw, split=split: [gemv.gemv(xs[k], w, rw=rw, split=split) for w in ws], 3)
                    row[f"rw{rw}_split{split}"] = round(sum(w.nbytes for w in ws) / statistics.median(tt) / 1e12, 3)
            sweep[f"{kind} {n}x{k}"] = dict(row, plan="rw{}_split{}".format(*gemv.plan(n, k)))
        out["gemv_plans_tb_s"] = sweep


def section_host(model, vocab: int) -> dict:
    """One decode step of the bare model at a short context: the host's time to build the step's graph
    (lazy, nothing runs) against the whole step (built and evaluated); per projection path."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.kernels import gemv

    out = {}
    for label, on in (("mlx", False), ("gemv", True)):
        _gemv_env(on)
        try:
            out[label] = _host_step(model, make_prompt_cache(model))
        except Exception as exc:  # noqa: BLE001
            out[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    _gemv_env(None)
    return out


def _host_step(model, cache) -> dict:
    mx.eval(model(mx.array([[5] * 16]), cache=cache))
    tok = mx.array([[7]])
    builds, steps = [], []
    for i in range(40):
        t0 = time.perf_counter()
        logits = model(tok, cache=cache)
        t1 = time.perf_counter()
        mx.eval(logits)
        t2 = time.perf_counter()
        if i >= 8:
            builds.append(t1 - t0)
            steps.append(t2 - t0)
    return {"graph_build_ms": round(statistics.median(builds) * 1e3, 3),
            "step_ms": round(statistics.median(steps) * 1e3, 3)}


def section_decode(model, parts, model_dir: Path, tokens: int, vocab: int) -> dict:
    from bench.bench_scheduler import aggregate_decode, mlx_lm_loop, steady_batch_decode
    from engine.engine import Engine
    from engine.kernels import gemv

    out = {"before_engine": {}}
    # mlx-lm as it comes: the model's own nn.Linear layers (the engine swaps them when it loads)
    steady_batch_decode(model, 8, 4, vocab)
    out["before_engine"]["plain_b1"] = round(mlx_lm_loop(model, tokens, vocab), 2)
    out["before_engine"]["generation_batch_b8"] = round(steady_batch_decode(model, 8, tokens, vocab), 2)
    engine = Engine(model_dir, name="roofline", loader=lambda: parts, cache_bytes=0).start()
    try:
        engine.wait_ready(1800)
        for label, on in (("mlx", False), ("gemv", True)):
            _gemv_env(on)
            try:
                for b in (1, 8):
                    aggregate_decode(engine, b, 8, vocab)  # this shape's kernels, off the clock
                row = {}
                for b in (1, 8):
                    phases = {}
                    aggregate_decode(engine, b, tokens, vocab, True, phases)
                    row[f"engine_b{b}"] = round(phases["decode"], 2)
                out[label] = row
            except Exception as exc:  # noqa: BLE001  (the GEMV's path failing leaves MLX's figures)
                out[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        _gemv_env(False)
        out["after_engine"] = {"plain_b1": round(mlx_lm_loop(model, tokens, vocab), 2),
                               "generation_batch_b8": round(steady_batch_decode(model, 8, tokens, vocab), 2)}
    finally:
        _gemv_env(None)
        engine.shutdown()
        engine.prefix_cache = engine.scheduler = None
        gc.collect()
        mx.clear_cache()
    return out


def serve_timed(engine, prompt: list[int], tokens: int) -> dict:
    """One request: the engine's own prefill / decode timings, plus each token's arrival and the host CPU."""
    from engine.sampling import SamplingParams
    from engine.sequence import Failed, Finished, Sequence, TextDelta

    done, arrivals = queue.Queue(), []

    def emit(ev):
        if isinstance(ev, TextDelta):
            arrivals.append((time.perf_counter(), len(ev.token_ids)))
        elif isinstance(ev, (Finished, Failed)):
            done.put(ev)

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    engine.submit(Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), emit))
    ev = done.get(timeout=1800)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    if isinstance(ev, Failed):
        raise ev.error
    steps = []
    for (t0, _), (t1, n) in zip(arrivals, arrivals[1:]):
        steps.extend([(t1 - t0) / n] * n)
    steps_ms = sorted(s * 1e3 for s in steps[2:]) or [0.0]
    med = statistics.median(steps_ms)
    return {"prefill_s": round(ev.prefill_s, 3), "decode_tok_s": round((ev.completion_tokens - 1) / ev.decode_s, 2),
            "step_ms": {"p10": round(steps_ms[len(steps_ms) // 10], 3), "median": round(med, 3),
                        "p90": round(steps_ms[9 * len(steps_ms) // 10], 3), "max": round(steps_ms[-1], 3),
                        "over_1_5x_median": sum(s > 1.5 * med for s in steps_ms)},
            "host_cpu_s_per_decode_s": round((cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime)
                                             / max(ev.decode_s + ev.prefill_s, 1e-9), 3)}


def section_turboquant(parts, model_dir: Path, contexts: list[int], tokens: int, chunk: int, warmup: int,
                       vocab: int) -> dict:
    from engine.engine import Engine
    from engine.kernels import common

    out = {"runs": [], "engines": []}
    for kv in ("none", "turboquant"):
        t0 = time.perf_counter()
        engine = Engine(model_dir, name=f"tq-{kv}", loader=lambda: parts, kv_quant=kv, max_batch=1,
                        prefill_step_size=chunk, cache_bytes=0).start()
        try:
            engine.wait_ready(1800)
            out["engines"].append({"kv": kv, "load_s": round(time.perf_counter() - t0, 3),
                                   "kernel_build_s": {str(c): round(s, 3) for c, s in engine.tq_kernel_build_s.items()}})
            if warmup:
                serve_timed(engine, list(range(10, 10 + warmup)), 4)
            for context in contexts:
                for run in (1, 2):
                    key = mx.random.key(context + 7919 * run)
                    prompt = mx.random.randint(10, min(30000, vocab - 2), (context,), key=key).tolist()
                    before = {"pool": pool_state(), "gpu": gpu_state(), "load_average": round(os.getloadavg()[0], 2)}
                    launched = dict(common.launches)
                    row = {"kv": kv, "context": context, "run": run, **serve_timed(engine, prompt, tokens)}
                    row["kernels"] = {k: v - launched.get(k, 0) for k, v in common.launches.items()
                                      if v != launched.get(k, 0)}
                    row["before"], row["gpu_after"] = before, gpu_state()
                    out["runs"].append(row)
                    print(json.dumps(row), flush=True)
        finally:
            engine.shutdown()
            engine.prefix_cache = engine.scheduler = None
            gc.collect()
            mx.clear_cache()
    by = {(r["kv"], r["context"], r["run"]): r["decode_tok_s"] for r in out["runs"]}
    out["tq_vs_dense"] = {str(c): [round(by["turboquant", c, r] / by["none", c, r], 3) for r in (1, 2)]
                          for c in contexts}
    return out


def child(args) -> dict:
    t0 = time.perf_counter()
    model, tokenizer, cfg = build(args.shape)
    vocab = cfg["vocab_size"]
    work = Path(tempfile.mkdtemp(prefix="roofline-"))
    model_dir = work / f"random-{args.shape}"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    parts = (model, tokenizer, cfg)
    out = {"pid": os.getpid(), "device": str(mx.default_device()), "mlx": mx.__version__,
           "env": {k: v for k, v in os.environ.items() if k.startswith(("PREFIXTRACE_", "MLX_"))},
           "build_s": round(time.perf_counter() - t0, 2), "gpu_start": gpu_state(), "pool_start": pool_state()}
    stamp = time.perf_counter()

    def done(name):
        nonlocal stamp
        out.setdefault("section_s", {})[name] = round(time.perf_counter() - stamp, 2)
        stamp = time.perf_counter()
        print(f"[child {args.index}] {name} done ({out['section_s'][name]} s)", file=sys.stderr, flush=True)

    out["bandwidth"] = section_bandwidth(args.copy_gib)
    done("bandwidth")
    bws = {"stated_4.8": STATED_BANDWIDTH, "measured_copy": out["bandwidth"]["copy_tb_s_best"] * 1e12,
           "measured_read": out["bandwidth"]["read_tb_s_best"] * 1e12}
    out["bytes"] = section_bytes(model, cfg, args.contexts, args.tokens, bws)
    out["weights"] = section_weights(model, plans=args.index == 0)
    done("weights")
    out["decode"] = section_decode(model, parts, model_dir, args.tokens, vocab)
    done("decode")
    out["host"] = section_host(model, vocab)  # after the engine swapped the projections (the GEMV's path)
    done("host")
    if args.contexts:
        out["turboquant"] = section_turboquant(parts, model_dir, args.contexts, args.tq_tokens, args.chunk,
                                               args.warmup, vocab)
        done("turboquant")
    out["total_s"] = round(time.perf_counter() - t0, 2)
    return out


# --------------------------------------------------------------------------------------------- parent


def figures(r: dict, contexts: list[int]) -> dict:
    """The figures of one process that the issue asks about, flat."""
    f = {}
    short = str(r["bytes"]["short_context"])
    f["step_bytes_short"] = r["bytes"]["step_bytes"][short]
    for name in ("copy_tb_s_best", "read_tb_s_best"):
        f[f"hbm_{name}"] = r["bandwidth"][name]
    for name, by_ctx in r["bytes"]["roofline_tok_s"].items():
        f[f"roofline_tok_s_{name}"] = by_ctx[short]
    w = r["weights"]
    f["mlx_weight_read_tb_s"] = w["mlx_sum_tb_s"]
    for kind in ("gate_proj", "down_proj", "k_proj", "lm_head"):
        if kind in w["mlx_by_kind_tb_s"]:
            f[f"mlx_gemv_{kind}_tb_s"] = w["mlx_by_kind_tb_s"][kind]
    if "gemv_sum_tb_s" in w:
        f["gemv_weight_read_tb_s"] = w["gemv_sum_tb_s"]
        f["gemv_vs_mlx"] = w["gemv_vs_mlx_same_matrices"]
    d = r["decode"]
    paths = [p for p in ("mlx", "gemv") if "error" not in d[p]]
    for path in paths:
        for b in (1, 8):
            f[f"engine_b{b}_{path}_tok_s"] = d[path][f"engine_b{b}"]
        f[f"engine_b8_over_b1_{path}"] = round(d[path]["engine_b8"] / d[path]["engine_b1"], 3)
        f[f"engine_b1_{path}_of_roofline_4.8"] = round(d[path]["engine_b1"] / f["roofline_tok_s_stated_4.8"], 3)
    for when in ("before_engine", "after_engine"):
        f[f"plain_b1_{when}_tok_s"] = d[when]["plain_b1"]
        f[f"generation_batch_b8_{when}_tok_s"] = d[when]["generation_batch_b8"]
    for path in paths:
        f[f"engine_b8_{path}_vs_generation_batch"] = round(d[path]["engine_b8"] / d["before_engine"]["generation_batch_b8"], 3)
    for label, h in r["host"].items():
        if "error" in h:
            continue
        f[f"host_graph_build_ms_{label}"] = h["graph_build_ms"]
        f[f"bare_step_ms_{label}"] = h["step_ms"]
    tq = r.get("turboquant")
    if tq:
        for row in tq["runs"]:
            f[f"{row['kv']}_{row['context']}_run{row['run']}_tok_s"] = row["decode_tok_s"]
        for c in contexts:
            for i, ratio in enumerate(tq["tq_vs_dense"][str(c)], 1):
                f[f"tq_vs_dense_{c}_run{i}"] = ratio
    return f


def targets(per_process: list[dict], contexts: list[int]) -> dict:
    """The issue's goals, each checked in every process (the best projection path for B = 1 / B = 8)."""
    def best(f, key):
        return max(f[key.format(path=p)] for p in ("mlx", "gemv") if key.format(path=p) in f)

    out = {
        "b1_ge_75pct_roofline": [best(f, "engine_b1_{path}_of_roofline_4.8") >= 0.75 for f in per_process],
        "b8_ge_6.5x_b1": [best(f, "engine_b8_over_b1_{path}") >= 6.5 for f in per_process],
        "b8_ge_1.0x_generation_batch": [best(f, "engine_b8_{path}_vs_generation_batch") >= 1.0 for f in per_process],
    }
    for c, goal in zip(contexts, (1.3, 2.0)):
        out[f"tq_ge_{goal}x_dense_at_{c}"] = [min(f[f"tq_vs_dense_{c}_run1"], f[f"tq_vs_dense_{c}_run2"]) >= goal
                                              for f in per_process]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=SHAPES, default="qwen3-8b",
                   help="qwen3-8b: random Qwen3-8B weights, bf16 (GPU); small: a CPU-sized Qwen3, float32")
    p.add_argument("--processes", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128, help="decode tokens per row at short context")
    p.add_argument("--tq-tokens", type=int, default=64, help="decode tokens per TurboQuant / dense long-context run")
    p.add_argument("--contexts", type=int, nargs="*", default=[32768, 100000],
                   help="TurboQuant vs dense contexts (none: skip that section)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk of the long-context engines")
    p.add_argument("--warmup", type=int, default=4096, help="prompt tokens each long-context engine serves first")
    p.add_argument("--copy-gib", type=float, default=4.0, help="size of the bandwidth probe's array")
    p.add_argument("--child-timeout", type=int, default=175, help="seconds each process may take")
    p.add_argument("--json", type=Path, help="write everything here (also each process's raw figures)")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.child.write_text(json.dumps(child(args)))
        return

    t0 = time.perf_counter()
    raw, errors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.processes):
            # beside --json where given: a run cut short still leaves each finished process's figures
            path = (args.json.with_name(f"{args.json.stem}-process{i}.json") if args.json else Path(tmp) / f"child-{i}.json")
            cmd = [sys.executable, __file__, "--child", str(path), "--index", str(i), "--shape", args.shape,
                   "--tokens", str(args.tokens), "--tq-tokens", str(args.tq_tokens), "--chunk", str(args.chunk),
                   "--warmup", str(args.warmup), "--copy-gib", str(args.copy_gib), "--contexts",
                   *map(str, args.contexts)]
            try:
                run = subprocess.run(cmd, timeout=args.child_timeout, stdout=subprocess.PIPE, text=True)
                rc = run.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc == 0 and path.exists():
                raw.append(json.loads(path.read_text()))
            else:
                errors.append(f"process {i}: exit {rc}")
                print(f"process {i}: exit {rc}", file=sys.stderr, flush=True)
    per_process = [figures(r, args.contexts) for r in raw]
    summary = {}
    for key in per_process[0] if per_process else []:
        values = [f[key] for f in per_process if key in f]
        lo, hi = min(values), max(values)
        summary[key] = {"readings": values, "median": round(statistics.median(values), 3),
                        "spread": round(hi / lo, 3) if lo else None}
    out = {"shape": args.shape, "processes": len(raw), "errors": errors, "wall_s": round(time.perf_counter() - t0, 1),
           "figures": summary, "targets": targets(per_process, args.contexts) if per_process else {},
           "raw": raw}
    if per_process:
        out["max_spread"] = {"dense": max((v["spread"] or 0) for k, v in summary.items()
                                          if k.startswith(("none_", "engine_", "plain_", "generation_"))),
                             "turboquant": max([(v["spread"] or 0) for k, v in summary.items()
                                                if k.startswith("turboquant_")] or [0])}
    width = max(map(len, summary), default=10)
    for key, v in summary.items():
        print(f"{key:<{width}}  median {v['median']:>10}  spread {v['spread']}  {v['readings']}")
    for key, ok in out["targets"].items():
        print(f"target {key}: {'met' if ok and all(ok) else 'NOT met'} {ok}")
    print(f"max spread: {out.get('max_spread')}  wall {out['wall_s']} s  errors: {errors or 'none'}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

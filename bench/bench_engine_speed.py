"""Engine speed (issue 17): every ratio of the issue beside its baseline, from one run.

    python bench/bench_engine_speed.py                          # CPU: the tiny fixture model
    python bench/bench_engine_speed.py --model DIR --prompt 2048
    python bench/bench_engine_speed.py --random qwen3-8b        # GPU: random Qwen3-8B shape, bf16, 32k prompt

One model is built once; the engines below share it (one at a time), so every
figure of a section is measured on the same weights in the same minutes.

1. prefill: a plain mlx-lm prefill (`generate_step`, the same chunk, to its first
   token) against the engine's cold TTFT with the prefix cache off, with the memory
   tier, and with memory + disk tier; plain mlx-lm alone at more chunk sizes (the
   measurement behind serve's per-device default chunk).
2. warm: the next turn (prompt + 32 tokens) from the memory tier, with and without a
   disk tier present, against its floor: one copy of the whole restored KV plus the
   32-token suffix's own compute, both timed here.
3. disk: a restarted cache restoring the prompt from disk (page cache dropped for its
   files) against a raw read of the same files, interleaved trials.
4. decode: engine B=1 (decode phase) against a plain mlx-lm `generate_step` loop, and
   engine B=8 against mlx-lm's `GenerationBatch` alone (bench_scheduler's functions).
5. pause: the stall of one pause/resume of a decoding row at several context lengths,
   through the prefix cache (the default) and through a spill file (no memory tier);
   measured at a 100k row when --pause-contexts reaches it, else extrapolated.

On a GPU the memory + disk tier is measured per way to the host (--host-copies, cache_blocks.HOST_COPY),
and the disk section checks blocks read back against the memory tier's (`blocks_match_memory`).

Prints one JSON object (also written to --out); "ratios" lists each target's figure
with its goal.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from bench.bench_cache_tiers import drop_page_cache, random_model  # noqa: E402
from bench.bench_pause import one as pause_once  # noqa: E402
from bench.bench_scheduler import aggregate_decode, mlx_lm_loop, steady_batch_decode  # noqa: E402
from bench.engine_io import ttft  # noqa: E402
from engine import cache_blocks  # noqa: E402
from engine.engine import Engine  # noqa: E402


def build(args, work: Path):
    if args.random:
        model_dir, loader, label = random_model(work)
    else:
        from engine.model_files import load_model_dir

        model_dir = args.model or ROOT / "fixtures" / "tiny-llama"
        loader, label = (lambda: load_model_dir(model_dir, args.dtype)), f"{Path(model_dir).name} ({args.dtype})"
    model, tokenizer, config = loader()
    return model, tokenizer, config, Path(model_dir), label


class Engines:
    """Engines over the one model, made on demand and shut down (their caches freed) at the end."""

    def __init__(self, model, tokenizer, config, model_dir, work: Path, chunk: int):
        self.parts, self.model_dir, self.work, self.chunk = (model, tokenizer, config), model_dir, work, chunk
        self.made: dict[str, Engine] = {}

    def get(self, name: str, **kw) -> Engine:
        if name not in self.made:
            e = Engine(self.model_dir, name=name, loader=lambda: self.parts, prefill_step_size=self.chunk, **kw)
            e.start().wait_ready(1800)
            ttft(e, [5, 6, 7, 8] * 8)  # kernels warm, off the clock
            self.made[name] = e
        return self.made[name]

    def close(self, name: str) -> None:
        e = self.made.pop(name, None)
        if e is not None:
            e.shutdown()
            e.prefix_cache = e.scheduler = None  # the parked engine thread keeps the Engine alive
            gc.collect()
            mx.clear_cache()


def rand_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, min(vocab, 30000) - 10) for _ in range(n)]


def plain_ttft(model, prompt: list[int], chunk: int) -> float:
    """mlx-lm's own prefill (`generate_step`, chunks of `chunk`) to its first token."""
    from mlx_lm.generate import generate_step, generation_stream

    mx.synchronize()
    t0 = time.perf_counter()
    steps = generate_step(mx.array(prompt), model, max_tokens=1, prefill_step_size=chunk)
    token, _ = next(steps)
    int(token)
    took = time.perf_counter() - t0
    for _ in steps:
        pass
    mx.synchronize(generation_stream)
    return took


def with_chunk(engine: Engine, chunk: int) -> Engine:
    engine.scheduler.prefill_chunk = chunk  # set while the engine is idle
    return engine


def kv_arrays(cache) -> list:
    return [a for c in cache for a in (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])]


def copy_floor_s(cache, repeats: int = 3) -> float:
    """One device copy of every restored layer (what joining the blocks costs at best)."""
    arrays = kv_arrays(cache)
    mx.eval(arrays)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = [a + mx.array(0, dtype=a.dtype) for a in arrays]
        mx.eval(out)
        best = min(best, time.perf_counter() - t0)
        del out
    return best


def suffix_compute_s(model, cache, suffix: list[int]) -> float:
    """The suffix's own prefill and first token on a cache already holding the prefix."""
    from mlx_lm.models.cache import KVCache

    own = []
    for c in cache:
        k = KVCache()
        k.keys, k.values, k.offset = c.keys, c.values, c.offset
        own.append(k)
    mx.eval([c.state for c in own])
    t0 = time.perf_counter()
    if len(suffix) > 1:
        model(mx.array(suffix[:-1])[None], cache=own)
        mx.eval([c.state for c in own])
    logits = model(mx.array(suffix[-1:])[None], cache=own)
    int(mx.argmax(logits[0, -1]))
    return time.perf_counter() - t0


def section_prefill(args, engines: Engines, model, vocab, rng, out):
    res = {"prompt_tokens": args.prompt, "plain_ttft_s": {}, "engine_ttft_s": {}, "ratio_vs_plain": {},
           "disk_writes_drained_s": {}}
    # MLX's CUDA backend builds kernels (attention graphs) per shape on first use, per thread:
    # every figure here is of a second run at its shapes; the first ones are reported apart.
    res["first_run_s"] = {}
    for chunk in args.sweep:
        res["first_run_s"][f"plain@{chunk}"] = round(plain_ttft(model, rand_prompt(rng, args.prompt, vocab), chunk), 3)
    sweep = {chunk: [] for chunk in args.sweep}
    for _ in range(args.repeats):  # interleaved across chunks: a load drift touches every chunk alike
        for chunk in args.sweep:
            sweep[chunk].append(plain_ttft(model, rand_prompt(rng, args.prompt, vocab), chunk))
    for chunk, times in sweep.items():
        res["plain_ttft_s"][chunk] = round(statistics.median(times), 4)
    res["sweep_all_s"] = {chunk: [round(t, 4) for t in times] for chunk, times in sweep.items()}
    res["best_plain_chunk"] = min(res["plain_ttft_s"], key=res["plain_ttft_s"].get)
    disk = dict(cache_bytes=args.cache_bytes, cache_dir=engines.work / "disk", cache_disk_bytes=args.disk_bytes)
    tiers = {"off": dict(cache_bytes=0), "memory": dict(cache_bytes=args.cache_bytes), "memory+disk": disk}
    default_copy = cache_blocks.HOST_COPY
    host_copy = {name: default_copy for name in tiers}
    if mx.default_device().type != mx.DeviceType.cpu:  # the other ways to the host (cache_blocks.HOST_COPY)
        for i, mode in enumerate(m for m in args.host_copies if m != default_copy):
            tiers[f"memory+disk({mode})"] = dict(disk, cache_dir=engines.work / f"disk{i + 2}")
            host_copy[f"memory+disk({mode})"] = mode
    res["host_copy"] = host_copy
    from engine import host_copy as driver

    res["driver_copy_available"] = driver.available()  # "dtoh" falls back to "writer" without it
    last_prompt = {}
    for chunk in args.chunks:
        for name, kw in tiers.items():
            e = with_chunk(engines.get(name, **kw), chunk)
            cache_blocks.HOST_COPY = host_copy[name]
            res["first_run_s"][f"{name}@{chunk}"] = round(ttft(e, rand_prompt(rng, args.prompt, vocab))[0], 3)
            e.prefix_cache.flush()
            print(f"  first run {name}@{chunk}: {res['first_run_s'][f'{name}@{chunk}']} s", file=sys.stderr, flush=True)
        times = {name: [] for name in ["plain", *tiers]}
        for _ in range(args.repeats):  # interleaved: drift touches every variant alike
            times["plain"].append(plain_ttft(model, rand_prompt(rng, args.prompt, vocab), chunk))
            for name, kw in tiers.items():
                e = with_chunk(engines.get(name, **kw), chunk)
                prompt = rand_prompt(rng, args.prompt, vocab)
                cache_blocks.HOST_COPY = host_copy[name]
                took, cached = ttft(e, prompt)
                assert cached == 0, cached
                times[name].append(took)
                last_prompt[name] = prompt
                t0 = time.perf_counter()
                e.prefix_cache.flush()  # the writer's backlog, if any: off the TTFT, timed here
                res["disk_writes_drained_s"].setdefault(f"{name}@{chunk}", []).append(round(time.perf_counter() - t0, 3))
        cache_blocks.HOST_COPY = default_copy
        med = {name: statistics.median(v) for name, v in times.items()}
        res["plain_ttft_s"].setdefault(chunk, round(med["plain"], 4))
        for name in tiers:
            res["engine_ttft_s"][f"{name}@{chunk}"] = round(med[name], 4)
            res["ratio_vs_plain"][f"{name}@{chunk}"] = round(med[name] / med["plain"], 3)
        res[f"plain_same_run@{chunk}"] = round(med["plain"], 4)
    out["prefill"] = res
    return last_prompt


def section_warm(args, engines: Engines, model, vocab, rng, prompts, out):
    res = {}
    for name in ("memory", "memory+disk"):
        e = engines.made.get(name)
        if e is None:
            continue
        base = prompts[name]
        first, _ = ttft(e, base + rand_prompt(rng, 32, vocab))  # this turn's shapes, built once
        turn = base + rand_prompt(rng, 32, vocab)
        took, cached = ttft(e, turn)
        hit = e.prefix_cache.lookup(turn[: len(base) + 1])  # engine idle: the prefix the turn restored
        floor_copy = copy_floor_s(hit.cache)
        suffix_compute_s(model, hit.cache, turn[hit.num_cached:])  # its shapes, built once on this thread
        suffix = suffix_compute_s(model, hit.cache, turn[hit.num_cached:])
        del hit
        res[name] = {"ttft_s": round(took, 4), "first_turn_s": round(first, 4), "cached": cached, "copy_floor_s": round(floor_copy, 4),
                     "suffix_compute_s": round(suffix, 4),
                     "ratio_vs_floor": round(took / (floor_copy + suffix), 2)}
        e.prefix_cache.flush()
    out["warm"] = res


def section_disk(args, engines: Engines, model, prompt, out):
    from engine.prefix_cache import PrefixCache

    e = engines.made.get("memory+disk")
    if e is None:
        return
    e.prefix_cache.flush()
    d = engines.work / "disk"
    probe = PrefixCache(model, max_bytes=0, cache_dir=d, model_dir=engines.model_dir)
    files = [probe.disk._path(k) for k in probe._chain(prompt[:-1])]
    probe.close()
    files = [f for f in files if f.exists()]
    trials = []
    for _ in range(args.trials):
        fresh = PrefixCache(model, max_bytes=args.cache_bytes, cache_dir=d, model_dir=engines.model_dir)
        drop_page_cache(files)
        t0 = time.perf_counter()
        hit = fresh.lookup(prompt)
        mx.eval([c.state for c in hit.cache])
        restore_s = time.perf_counter() - t0
        nbytes = sum(f.stat().st_size for f in files)
        got = hit.num_cached
        fresh.close()
        del hit, fresh
        gc.collect()
        drop_page_cache(files)
        t0 = time.perf_counter()
        raw = sum(len(f.read_bytes()) for f in files)
        raw_s = time.perf_counter() - t0
        trials.append({"cached": got, "restore_gb_s": round(nbytes / restore_s / 1e9, 3),
                       "raw_same_files_gb_s": round(raw / raw_s / 1e9, 3), "ratio": round(raw_s / restore_s, 3)})
    out["disk"] = {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "trials": trials,
                   "median_ratio": statistics.median(t["ratio"] for t in trials),
                   "blocks_match_memory": disk_blocks_match(e.prefix_cache, prompt)}


def disk_blocks_match(pc, prompt) -> dict:
    """Whether blocks read back from the disk tier hold the memory tier's bytes (first, middle,
    last block of the prompt): checks the device-to-host path the writer took (cache_blocks.HOST_COPY)."""
    import numpy as np

    from engine.cache_blocks import named_arrays

    keys = [k for k in pc._chain(prompt[:-1]) if k in pc.memory]
    checked = {}
    for key in {keys[0], keys[len(keys) // 2], keys[-1]} if keys else ():
        found = pc.disk.get(key)
        if found is None:
            checked[key.hex()[:12]] = "not on disk"
            continue
        _, arrays = found
        mem = named_arrays(pc.memory.get(key).layers)
        same = all(np.array_equal(arrays[name][0], np.array((a + 0).view(mx.uint16) if a.dtype == mx.bfloat16 else a + 0))
                   for name, a in mem.items())
        checked[key.hex()[:12]] = bool(same and set(arrays) == set(mem))
    return checked


def section_decode(args, engines: Engines, model, vocab, out):
    e = engines.get("off", cache_bytes=0)
    for b in (1, 8):
        aggregate_decode(e, b, 8, vocab)  # this batch shape's kernels, off the clock
    runs = {"engine_b1": [], "engine_b8": [], "engine_b1_end_to_end": [], "engine_b8_end_to_end": [],
            "plain_b1": [], "generation_batch_b8": []}
    for _ in range(args.repeats):
        for b in (1, 8):
            phases = {}
            runs[f"engine_b{b}_end_to_end"].append(aggregate_decode(e, b, args.decode_tokens, vocab, True, phases))
            runs[f"engine_b{b}"].append(phases["decode"])
        runs["plain_b1"].append(mlx_lm_loop(model, args.decode_tokens, vocab))
        runs["generation_batch_b8"].append(steady_batch_decode(model, 8, args.decode_tokens, vocab))
    # B=1 diagnostic: GenerationBatch alone.
    steady_batch_decode(model, 1, 8, vocab)
    runs["generation_batch_b1"] = [steady_batch_decode(model, 1, args.decode_tokens, vocab)]
    med = {k: statistics.median(v) for k, v in runs.items()}
    out["decode"] = {"tok_s": {k: round(v, 2) for k, v in med.items()},
                     "runs": {k: [round(x, 1) for x in v] for k, v in runs.items()},
                     "b1_vs_plain": round(med["engine_b1"] / med["plain_b1"], 3),
                     "b8_vs_generation_batch": round(med["engine_b8"] / med["generation_batch_b8"], 3)}


def section_pause(args, engines: Engines, out):
    for name in [n for n in engines.made if n != "off"]:  # the prefill section's tiers: their memory back
        engines.close(name)
    res = {}
    # The memory tier holds the largest paused row's blocks (a 100k row of the 8B shape: 14.7 GB).
    held = max(args.cache_bytes, int(1.2 * args.kv_per_token * max(args.pause_contexts)))
    for name, kw, contexts in (("prefix_cache", dict(cache_bytes=held), args.pause_contexts),
                               ("spill_file", dict(cache_bytes=0), args.spill_contexts or args.pause_contexts)):
        e = engines.get(f"pause-{name}", **kw)
        with_chunk(e, args.chunks[-1])
        pause_once(e, 256)
        res[name] = [pause_once(e, c) for c in contexts]
        engines.close(f"pause-{name}")
    for name, rows in res.items():
        xs = [r["context_tokens"] for r in rows]
        if len(xs) >= 2 and xs[-1] < 100_000:  # linear growth per token from the two largest contexts, to a 100k row
            (x0, r0), (x1, r1) = (xs[-2], rows[-2]), (xs[-1], rows[-1])
            slope = (r1["stall_s"] - r0["stall_s"]) / (x1 - x0)
            rows.append({"extrapolated_100k_stall_s": round(r1["stall_s"] + slope * (100_000 - x1), 3)})
        elif xs and xs[-1] >= 100_000:
            rows.append({"measured_100k_stall_s": rows[-1]["stall_s"]})
    out["pause"] = res


def _profiled_engine(engine: Engine, work) -> str:
    """cProfile of the engine thread's scheduler steps while `work()` runs (top by own time)."""
    import cProfile
    import io
    import pstats

    pr, sch = cProfile.Profile(), engine.scheduler
    step = sch.step

    def profiled():
        pr.enable()
        try:
            step()
        finally:
            pr.disable()

    sch.step = profiled
    t0 = time.perf_counter()
    try:
        work()
    finally:
        sch.step = step
    wall = time.perf_counter() - t0
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(14)
    return f"wall {wall:.3f} s\n" + "\n".join(line for line in text.getvalue().splitlines() if line.strip())


def section_profile(args, engines: Engines, model, vocab, rng, prompts, out):
    """Where the engine thread's time goes: a cold prefill, a warm turn, B=1 decode."""
    import cProfile
    import io
    import pstats

    res = {}
    e = engines.get("memory", cache_bytes=args.cache_bytes)
    chunk = args.chunks[0]
    with_chunk(e, chunk)
    res[f"cold_prefill@{chunk}"] = _profiled_engine(e, lambda: ttft(e, rand_prompt(rng, args.prompt, vocab)))
    base = prompts.get("memory") or rand_prompt(rng, args.prompt, vocab)
    res["warm_turn"] = _profiled_engine(e, lambda: ttft(e, base + rand_prompt(rng, 32, vocab)))
    off = engines.get("off", cache_bytes=0)
    res["decode_b1"] = _profiled_engine(off, lambda: aggregate_decode(off, 1, args.decode_tokens, vocab))
    pr = cProfile.Profile()
    pr.enable()
    mlx_lm_loop(model, args.decode_tokens, vocab)
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(10)
    res["plain_loop_b1"] = "\n".join(line for line in text.getvalue().splitlines() if line.strip())
    out["profile"] = res
    for name, text in res.items():
        print(f"--- profile: {name}\n{text}", file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="mlx-lm model directory (default: fixtures/tiny-llama)")
    p.add_argument("--random", choices=["qwen3-8b"], help="random-weight model of this shape (GPU figures)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt", type=int, help="prompt tokens (default 32768 with --random, else 8192)")
    p.add_argument("--chunks", default="512,2048", help="prefill chunks the engine is measured at")
    p.add_argument("--sweep", default="256,512,1024,2048,4096", help="chunks plain mlx-lm alone is timed at")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--trials", type=int, default=3, help="disk restore / raw read trials")
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--pause-contexts", default=None, help="default 8192,32768 with --random, else 1024,4096")
    p.add_argument("--spill-contexts", default=None, help="contexts of the spill-file pauses (default: --pause-contexts)")
    p.add_argument("--host-copies", default="dtoh,writer",
                   help="on a GPU, the disk tier's ways to the host measured side by side (cache_blocks.HOST_COPY)")
    p.add_argument("--cache-gb", type=float, default=None, help="memory tier (default: 3 prompts' KV)")
    p.add_argument("--disk-gb", type=float, default=None, help="each disk tier's budget (default: every prompt's KV)")
    p.add_argument("--only", default="prefill,warm,disk,decode,pause", help="sections (also: profile)")
    p.add_argument("--dir", type=Path, help="work directory (the disk tier; default a temporary one)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if sys.platform == "linux" and mx.default_device() == mx.cpu:
        # The figures must be serve's: serve re-execs with OpenBLAS, and without it
        # MLX's reference BLAS makes a CPU prefill ~12x slower (docs/PERFORMANCE.md).
        from engine.cpu_runtime import maybe_reexec_with_openblas

        maybe_reexec_with_openblas()
    args.prompt = args.prompt or (32768 if args.random else 8192)
    args.chunks = [int(c) for c in args.chunks.split(",")]
    args.sweep = [int(c) for c in args.sweep.split(",")]
    args.pause_contexts = [int(c) for c in (args.pause_contexts or ("8192,32768" if args.random else "1024,4096")).split(",")]
    args.spill_contexts = [int(c) for c in args.spill_contexts.split(",")] if args.spill_contexts else None
    args.host_copies = args.host_copies.split(",")
    only = set(args.only.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench-speed-", dir=args.dir))
    out = {"device": str(mx.default_device()), "load_average": os.getloadavg()[0],
           "openblas_preloaded": os.environ.get("PREFIXTRACE_OPENBLAS_PRELOADED")}
    try:
        t0 = time.perf_counter()
        model, tokenizer, config, model_dir, label = build(args, work)
        a = model.args
        kv_per_token = 2 * a.num_hidden_layers * a.num_key_value_heads * (getattr(a, "head_dim", None) or
                                                                          a.hidden_size // a.num_attention_heads)
        kv_per_token *= 2 if args.random else 4
        args.cache_bytes = int(args.cache_gb * 1e9) if args.cache_gb else 3 * kv_per_token * (args.prompt + 512)
        args.disk_bytes = int(args.disk_gb * 1e9) if args.disk_gb else \
            4 * kv_per_token * args.prompt * (len(args.chunks) * args.repeats + 2)
        args.kv_per_token = kv_per_token
        out.update(model=label, build_s=round(time.perf_counter() - t0, 1), kv_bytes_per_token=kv_per_token,
                   memory_tier_bytes=args.cache_bytes)
        vocab = int(config["vocab_size"])
        rng = random.Random(0)
        engines = Engines(model, tokenizer, config, model_dir, work, args.chunks[-1])
        prompts = {}
        for name, run in (("prefill", lambda: prompts.update(section_prefill(args, engines, model, vocab, rng, out))),
                          ("warm", lambda: section_warm(args, engines, model, vocab, rng, prompts, out)),
                          ("disk", lambda: section_disk(args, engines, model, prompts.get("memory+disk", []), out)),
                          ("decode", lambda: section_decode(args, engines, model, vocab, out)),
                          ("pause", lambda: section_pause(args, engines, out)),
                          ("profile", lambda: section_profile(args, engines, model, vocab, rng, prompts, out))):
            if name in only and (name not in ("warm", "disk") or prompts):  # profile: only when asked
                t1 = time.perf_counter()
                run()
                out.setdefault("section_s", {})[name] = round(time.perf_counter() - t1, 1)
                print(f"[{name} done in {out['section_s'][name]} s]", file=sys.stderr, flush=True)
                if args.out:  # what is done so far survives a later section's crash or time limit
                    args.out.write_text(json.dumps(out, indent=2))
        for name in list(engines.made):
            engines.close(name)
        out["ratios"] = ratios(out)
        out["load_average_end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


def ratios(out: dict) -> dict:
    """Each target of issue 17 with its figure from this run."""
    r = {}
    pre = out.get("prefill", {}).get("ratio_vs_plain", {})
    for key, v in pre.items():
        if not key.startswith("off"):
            r[f"cold prefill, cache {key} / plain mlx-lm (goal <= 1.05)"] = v
    for name, w in out.get("warm", {}).items():
        r[f"warm turn, {name}: TTFT / (KV copy + suffix compute) (goal <= 3)"] = w["ratio_vs_floor"]
    if "disk" in out:
        r["disk restore / raw read of the same files (goal >= 0.9)"] = out["disk"]["median_ratio"]
    if "decode" in out:
        r["decode B=1 engine / plain mlx-lm loop (goal >= 0.95)"] = out["decode"]["b1_vs_plain"]
        r["decode B=8 engine / GenerationBatch alone (goal >= 0.95)"] = out["decode"]["b8_vs_generation_batch"]
    for name, rows in out.get("pause", {}).items():
        if rows and "extrapolated_100k_stall_s" in rows[-1]:
            r[f"pause stall, {name}, extrapolated to a 100k row, s (goal <= 1 on the H200)"] = \
                rows[-1]["extrapolated_100k_stall_s"]
        if rows and "measured_100k_stall_s" in rows[-1]:
            r[f"pause stall, {name}, a 100k row, s (goal <= 1 on the H200)"] = rows[-1]["measured_100k_stall_s"]
    return r


if __name__ == "__main__":
    main()

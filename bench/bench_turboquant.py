"""TurboQuant KV quality, size and speed against the dense cache, side by side.

    python bench/bench_turboquant.py            # codec + tiny fixture model
    python bench/bench_turboquant.py --quick    # fewer samples
    python bench/bench_turboquant.py --smollm2 --quick  # the bundled trained model, one sample (~3 min)
    python bench/bench_turboquant.py --smollm2  # both samples, 1024 + 256 tokens (~10 min on 2 busy cores)
    python bench/bench_turboquant.py --engine-decode 32768 --engine-decode 100000  # GPU: engine, dense vs TurboQuant
    python bench/bench_turboquant.py --engine-decode 8192 --engine-shape tiny --engine-chunk 512 \
        --engine-warmup 512 --engine-tokens 4 --engine-chunked-too  # CPU: cold prefill, dense KV vs chunked on TQ

Default: per bit width, D_mse of unit vectors (the paper's per-vector figure),
KV bytes vs bf16 at a 64-dim head, attention-output relative error and
teacher-forced greedy next-token agreement vs dense on fixtures/tiny-llama
(float32), then decode step time dense vs TurboQuant.

--smollm2: the bundled SmolLM2-135M-Instruct loaded as `prefixtrace serve`
loads it on the CPU (re-exec with OpenBLAS preloaded, dense float32 weights),
real text from this repository (English docs, Python code). See
`trained_model_quality`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.tq_cache import BatchTurboQuantKVCache, TurboQuantKVCache  # noqa: E402
from engine.tq_config import make_tq_cache, to_turboquant  # noqa: E402
from engine.turboquant import get_codec  # noqa: E402
from testsupport.tq_quality import (  # noqa: E402
    GAUSSIAN_LLOYD_MAX, PAPER_D_MSE, Bfloat16KVCache, SplitCache, attention_error, compare_logprobs,
    continuation_logits, distortion, kv_bytes_per_token, kv_bytes_ratio, layer_inputs, load, next_token_agreement,
    used_nbytes,
)

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "fixtures" / "tiny-llama"


def load_tiny(dtype=mx.float32):
    return load(TINY_MODEL, dtype)


def decode_step_ms(model, caches, context: int, steps: int = 32, rows: int = 1) -> float:
    """Median ms per batched decode step after `context` tokens per row."""
    prompt = mx.random.randint(0, 500, (1, context))
    per_row = []
    for _ in range(rows):
        row = caches()
        for start in range(0, context, 512):
            model(prompt[:, start : start + 512], cache=row)
        mx.eval([c.state for c in row])
        per_row.append(row)
    batch = [layer.merge([r[i] for r in per_row]) for i, layer in enumerate(per_row[0])]
    token = mx.zeros((rows, 1), dtype=mx.int32)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(token, cache=batch)
        mx.eval(logits)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[steps // 4 :])


# --- a trained model on real text -------------------------------------------------

# Real text from this repository: English prose and Python code, read at a fixed commit
# (the files keep changing; the figures in docs/PERFORMANCE.md are for this text).
TEXT_SAMPLES = {
    "docs": ("docs/ARCHITECTURE.md", "docs/CACHE.md", "docs/TURBOQUANT.md"),
    "code": ("engine/scheduler.py", "engine/prefix_cache.py"),
}
TEXT_REV = "f086436"


def read_text(path: str, rev: str | None = TEXT_REV) -> str:
    """`path` as of commit `rev` (the working tree's copy when `rev` is None or git cannot say)."""
    if rev:
        done = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True)
        if done.returncode == 0:
            return done.stdout
        print(f"{path} at {rev}: {done.stderr.strip()}; using the working tree's copy", file=sys.stderr)
    return (ROOT / path).read_text()


def text_tokens(tokenizer, name: str, n: int, rev: str | None = TEXT_REV) -> list[int]:
    text = "\n\n".join(read_text(p, rev) for p in TEXT_SAMPLES[name])
    ids = tokenizer.encode(text[: 8 * n])  # ≥ 2 characters a token, and no over-length warning
    if len(ids) < n:
        raise SystemExit(f"sample {name!r} has {len(ids)} tokens, {n} wanted")
    return ids[:n]


def quality_configs(model, bits_list, affine_bits=(4,)) -> list[tuple[str, object]]:
    """(name, cache factory) per setting: dense K/V rounded to bf16 (a floor); TurboQuant
    with every layer quantised and with the last layer dense (the engine's default);
    mlx-lm's affine QuantizedKVCache (group 64) at the same bits, as a baseline; at the
    highest bit width, TurboQuant on the keys only / values only, and the same bytes
    split unevenly (keys one bit more, values one bit less)."""
    n = len(model.layers)
    configs = [("bf16 KV (reference)", lambda: [Bfloat16KVCache() for _ in range(n)])]
    for bits in bits_list:
        configs.append((f"tq{bits} all layers", lambda b=bits: make_tq_cache(model, bits=b, dense_layers=())))
        configs.append((f"tq{bits} last dense", lambda b=bits: make_tq_cache(model, bits=b)))
        if bits in affine_bits:
            configs.append((f"affine{bits} (mlx-lm)", lambda b=bits: [QuantizedKVCache(64, b) for _ in range(n)]))
    top = max(bits_list)
    configs.append((f"tq{top} keys only, all", lambda: [
        SplitCache(TurboQuantKVCache(top), KVCache()) for _ in range(n)]))
    configs.append((f"tq{top} values only, all", lambda: [
        SplitCache(KVCache(), TurboQuantKVCache(top)) for _ in range(n)]))
    configs.append((f"tq K{top + 1}/V{top - 1}, all", lambda: [
        SplitCache(TurboQuantKVCache(top + 1), TurboQuantKVCache(top - 1)) for _ in range(n)]))
    return configs


def trained_model_quality(model, tokenizer, samples, prompt: int, cont: int, bits_list, layers,
                          affine_bits=(4,), rev: str | None = TEXT_REV) -> None:
    """TurboQuant vs dense on a trained model and real text, side by side per sample."""
    if prompt % 64:
        raise SystemExit("--prompt must be a multiple of 64 (the TurboQuant group)")
    configs = quality_configs(model, bits_list, affine_bits)
    for name in samples:
        tokens = text_tokens(tokenizer, name, prompt + cont + 1, rev)
        targets = mx.array(tokens[prompt + 1 :])
        t0 = time.perf_counter()
        dense = make_prompt_cache(model)
        ref = continuation_logits(model, tokens, dense, prompt)
        dense_bytes = kv_bytes_per_token(dense, prompt + cont)
        print(f"\nsample {name!r} ({', '.join(TEXT_SAMPLES[name])} at {rev or 'the working tree'}): "
              f"prompt {prompt}, continuation {cont} teacher-forced; dense reference {time.perf_counter() - t0:.1f} s, "
              f"NLL {-mx.mean(mx.take_along_axis(ref, targets[:, None], axis=-1)).item():.3f} nats/token, "
              f"KV {dense_bytes:.0f} B/token (float32), load {os.getloadavg()[0]:.2f}")
        print(f"  {'setting':<22} {'agree':>6} {'KL nats':>8} {'dNLL':>7} {'flip margin':>11} "
              f"{'B/token':>8} {'/dense':>7} {'s':>5}")
        for label, factory in configs:
            t0 = time.perf_counter()
            cache = factory()
            r = compare_logprobs(ref, continuation_logits(model, tokens, cache, prompt), targets)
            nb = kv_bytes_per_token(cache, prompt + cont)
            flip = "-" if r["flip_margin"] is None else f"{r['flip_margin']:.2f}"
            print(f"  {label:<22} {r['agree']:6.3f} {r['kl']:8.4f} {r['dnll']:+7.4f} {flip:>11} {nb:8.0f} "
                  f"{nb / dense_bytes:7.3f} "
                  f"{time.perf_counter() - t0:5.1f}")
        print(f"  (median top-1 vs top-2 log-prob margin of the dense reference: {r['margin']:.2f})")
        x = mx.array(tokens[:prompt])[None]
        prepared = layer_inputs(model, x)
        print(f"  attention-output rel. error, {prompt}-token prompt, layers {layers}: K and V / K only / V only")
        for bits in bits_list:
            row = [attention_error(model, x, bits, side=side, prepared=prepared) for side in ("kv", "k", "v")]
            cells = "  ".join(" / ".join(f"{errs[i]:.3f}" for errs in row) for i in layers)
            means = " / ".join(f"{statistics.mean(errs):.3f}" for errs in row)
            print(f"  tq{bits}: {cells}   mean over {len(row[0])} layers {means}")
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


def timings(name, model, contexts, rows_list):
    print(f"\ndecode step ms, {name} (dense -> TurboQuant 4-bit, last layer dense)")
    for context in contexts:
        for rows in rows_list:
            dense = decode_step_ms(model, lambda: make_prompt_cache(model), context, rows=rows)
            tq = decode_step_ms(model, lambda: make_tq_cache(model, bits=4), context, rows=rows)
            print(f"  context {context:>5}  rows {rows}: {dense:7.2f} -> {tq:7.2f}  ({tq / dense:.2f}x)")


def smollm2_main(args) -> None:
    if sys.platform == "linux":
        from engine.cpu_runtime import maybe_reexec_with_openblas

        maybe_reexec_with_openblas()  # as `prefixtrace serve`: OpenBLAS, hence dense float32 weights
    from engine.cpu_runtime import load_model
    from engine.default_model import default_model_dir

    load_start = os.getloadavg()[0]
    model, tokenizer = load_model(default_model_dir())
    import mlx.nn as nn

    dense_weights = not any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    print(f"SmolLM2-135M-Instruct, float32 activations, {'dense' if dense_weights else 'QUANTIZED (slow path)'} "
          f"weights, LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}, load average {load_start:.2f}")
    prompt, cont = (512, 128) if args.quick else (args.prompt, args.continuation)
    samples = ("docs",) if args.quick else tuple(args.samples.split(","))
    n = len(model.layers)
    affine = tuple(int(b) for b in args.affine_bits.split(",") if b)
    trained_model_quality(model, tokenizer, samples, prompt, cont, (2, 3, 4), (0, 1, n // 2, n - 2, n - 1), affine,
                          args.text_rev or None)
    if args.timing:
        timings("SmolLM2-135M (default model)", model, (512, 2048), (1, 3))


# --engine-shape small: a Qwen3-shaped random model the CPU prefills a few thousand tokens of
# in seconds (float32), for the cold-prefill before/after on this VM.
SMALL_QWEN3 = dict(
    model_type="qwen3", hidden_size=512, num_hidden_layers=12, intermediate_size=1536,
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, rms_norm_eps=1e-6,
    vocab_size=4096, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False,
)


def engine_decode(contexts, tokens: int, chunk: int, warmup: int = 4096, shape: str = "qwen3-8b",
                  chunked_too: bool = False, repeat: int = 1, dense: bool = True, probe_build: bool = False) -> dict:
    """Whole-model figures through the engine, dense and `--kv-quant turboquant` side by side
    on one random Qwen3-8B-shaped model (bf16; GPU): per context, the cold prefill time and
    the decode tokens/s of one row (the engine's own `Finished` timings). `warmup`: each engine first serves one request of this many prompt tokens
    (not recorded), so the kernels' first-shape compilations (prefill chunks, decode) stay out
    of the figures. `shape`: "qwen3-8b" (bf16) or "small" (`SMALL_QWEN3`, float32, for the
    CPU). `chunked_too`: the TurboQuant engine also runs with its cold prefill chunked on
    the TurboQuant caches (the engine's cold_dense_prefill off: the path before the
    dense cold prefill), labelled `..._chunked`, for a before/after in one run. `repeat`: each engine
    serves each context this many times (other tokens each time, `run` 1, 2, ...): the first
    run pays what is built per shape (kernels, cuDNN graphs), the next ones not. `dense`:
    False skips the dense engine. `probe_build`: after the engines, time
    `engine.kernels.prebuild.prebuild_tq` (every decode-kernel build; one no engine built costs
    its compile, one already built ~nothing). Each engine's load time and the kernels it built
    at load (`Engine.tq_kernel_build_s`, PREFIXTRACE_TQ_PREBUILD) are in `engines`."""
    import queue

    from bench.bench_scheduler import QWEN3_8B, random_loader
    from engine.kernels import prebuild
    from engine.tq_config import TQConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    from engine.sequence import Failed, Finished, Sequence

    small, tiny = shape == "small", shape == "tiny"
    if tiny:  # fixtures/tiny-llama, loaded by each engine as `prefixtrace serve` would
        built, vocab = None, json.loads((ROOT / "fixtures/tiny-llama/config.json").read_text())["vocab_size"]
    else:
        built = random_loader(SMALL_QWEN3 if small else QWEN3_8B, mx.float32 if small else mx.bfloat16)()  # one for all
        vocab = (SMALL_QWEN3 if small else QWEN3_8B)["vocab_size"]
    out = {"device": str(mx.default_device()), "shape": shape, "tokens": tokens, "prefill_chunk": chunk,
           "warmup": warmup, "repeat": repeat, "tq_prebuild": os.environ.get("PREFIXTRACE_TQ_PREBUILD", "1") != "0",
           "mlx_ptx_cache_dir": os.environ.get("MLX_PTX_CACHE_DIR"),
           "load_average_start": round(os.getloadavg()[0], 2), "runs": [], "engines": []}

    def serve(engine, context, n_tokens, run=1):
        done = queue.Queue()
        key = mx.random.key(context + 7919 * (run - 1))  # another prompt per run: nothing to reuse
        prompt = mx.random.randint(10, min(30000, vocab - 2), (context,), key=key).tolist()
        seq = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True),
                       lambda ev: done.put(ev) if isinstance(ev, (Finished, Failed)) else None)
        engine.submit(seq)
        ev = done.get(timeout=1800)
        if isinstance(ev, Failed):
            raise ev.error
        return ev

    labels = []
    runs = [("none", False)] * dense + [("turboquant", False)]
    if chunked_too:
        # Then each TurboQuant engine again: the first one of a process pays first-shape
        # compilations at the long context that the warm-up did not reach (a new decode
        # context, the encoder's and the codec's shapes), and the second round is free of them.
        runs += [("turboquant", True), ("turboquant", False), ("turboquant", True)]
    for kv, chunked in runs:
        label = kv + ("_chunked" if chunked else "")
        label += "_again" if label in labels else ""
        labels.append(label)
        model_kw = dict(model_dir=str(ROOT / "fixtures/tiny-llama"), dtype="float32") if tiny else \
            dict(model_dir="random-qwen3-8b", loader=lambda: built)
        t0 = time.perf_counter()
        engine = Engine(**model_kw, kv_quant=kv, max_batch=1, prefill_step_size=chunk, cache_bytes=0,
                        cold_dense_prefill=not chunked).start()
        try:
            engine.wait_ready(600)
            built_s = {("reduces" if c < 0 else str(c or "encode")): round(s, 3) for c, s in engine.tq_kernel_build_s.items()}
            out["engines"].append({"kv": label, "load_s": round(time.perf_counter() - t0, 3), "kernel_build_s": built_s})
            print(json.dumps(out["engines"][-1]), flush=True)
            if warmup:
                serve(engine, warmup, 4)
            for context in contexts:
                for run in range(1, repeat + 1):
                    ev = serve(engine, context, tokens, run)
                    row = {"kv": label, "context": context, "run": run, "prefill_s": round(ev.prefill_s, 3),
                           "decode_tok_s": round((ev.completion_tokens - 1) / ev.decode_s, 2)}
                    out["runs"].append(row)
                    print(json.dumps(row), flush=True)
        finally:
            engine.shutdown()
            mx.clear_cache()
    if probe_build and not tiny:
        probe = prebuild.prebuild_tq(built[0], TQConfig(), 1)
        out["probe_build_s"] = {("reduces" if c < 0 else str(c or "encode")): round(s, 3) for c, s in probe.items()}
        print(json.dumps({"probe_build_s": out["probe_build_s"]}), flush=True)
    by = {(r["kv"], r["context"], r["run"]): r for r in out["runs"]}
    runs_ = range(1, repeat + 1)
    tag = (lambda r: "") if repeat == 1 else (lambda r: f"_run{r}")
    out["ratios"] = {str(c): {f"{label}{tag(r)}_{what}_vs_dense": round(by[label, c, r][key] / by["none", c, r][key], 3)
                              for label in labels[1:] if dense for r in runs_
                              for what, key in (("decode", "decode_tok_s"), ("prefill", "prefill_s"))}
                     for c in contexts}
    if repeat > 1:  # what the first run paid that the second did not, per engine
        for c in contexts:
            for label in labels:
                out["ratios"][str(c)][f"{label}_prefill_first_minus_second_s"] = round(
                    by[label, c, 1]["prefill_s"] - by[label, c, 2]["prefill_s"], 3)
    if chunked_too:  # after / before, the same context
        for c in contexts:
            for again in ("", "_again"):
                out["ratios"][str(c)][f"turboquant{again}_prefill_vs_chunked"] = round(
                    by["turboquant" + again, c, 1]["prefill_s"] / by["turboquant_chunked" + again, c, 1]["prefill_s"], 3)
    out["load_average_end"] = round(os.getloadavg()[0], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--engine-decode", type=int, action="append", metavar="CONTEXT",
                        help="GPU: whole-model prefill and decode tok/s through the engine, dense vs TurboQuant, "
                        "random Qwen3-8B shape, at this context (repeatable)")
    parser.add_argument("--engine-tokens", type=int, default=32)
    parser.add_argument("--engine-chunk", type=int, default=2048)
    parser.add_argument("--engine-warmup", type=int, default=4096,
                        help="prompt tokens of one unrecorded request per engine first (0: none)")
    parser.add_argument("--engine-shape", choices=("qwen3-8b", "small", "tiny"), default="qwen3-8b",
                        help="--engine-decode: the random model (small: a CPU-sized Qwen3 shape, float32; tiny: fixtures/tiny-llama)")
    parser.add_argument("--engine-chunked-too", action="store_true",
                        help="--engine-decode: TurboQuant also with its cold prefill chunked on TurboQuant "
                        "caches (the path before session 6), for a before/after")
    parser.add_argument("--engine-repeat", type=int, default=1,
                        help="--engine-decode: serve each context this many times per engine (first vs second run)")
    parser.add_argument("--engine-no-dense", action="store_true", help="--engine-decode: TurboQuant engines only")
    parser.add_argument("--engine-probe-build", action="store_true",
                        help="--engine-decode: then time building every TurboQuant decode kernel (engine/kernels/prebuild.py)")
    parser.add_argument("--json", type=Path, help="--engine-decode: also write the figures here")
    parser.add_argument("--skip-tiny-timing", action="store_true")
    parser.add_argument("--smollm2", action="store_true", help="quality on the bundled trained model instead")
    parser.add_argument("--prompt", type=int, default=1024, help="--smollm2: prompt tokens (multiple of 64)")
    parser.add_argument("--continuation", type=int, default=256, help="--smollm2: teacher-forced tokens compared")
    parser.add_argument("--samples", default="docs,code", help=f"--smollm2: of {','.join(TEXT_SAMPLES)}")
    parser.add_argument("--text-rev", default=TEXT_REV,
                        help="--smollm2: the commit the sample text is read at ('' for the working tree)")
    parser.add_argument("--affine-bits", default="4",
                        help="--smollm2: bit widths of the mlx-lm affine baseline (slow: its SDPA), e.g. 2,3,4")
    parser.add_argument("--timing", action="store_true", help="--smollm2: also decode step times")
    args = parser.parse_args()
    if args.engine_decode:
        out = engine_decode(args.engine_decode, args.engine_tokens, args.engine_chunk, args.engine_warmup,
                            args.engine_shape, args.engine_chunked_too, args.engine_repeat, not args.engine_no_dense,
                            args.engine_probe_build)
        print(json.dumps(out, indent=1))
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        return
    if args.smollm2:
        return smollm2_main(args)
    n = 2048 if args.quick else 16384

    print("bits  D_mse(d=128)  paper  gaussian-LM  bytes/bf16(d=64)  bytes/bf16(d=128)")
    for bits in (1, 2, 3, 4, 8):
        d = distortion(128, bits, n)
        print(f"{bits:>4}  {d:12.4f}  {PAPER_D_MSE.get(bits, float('nan')):5.3f}  "
              f"{GAUSSIAN_LLOYD_MAX.get(bits, float('nan')):11.4f}  {kv_bytes_ratio(64, bits):16.3f}  "
              f"{kv_bytes_ratio(128, bits):17.3f}")

    model, _ = load_tiny()
    tokens = mx.random.randint(0, 500, (1, 512), key=mx.random.key(3))
    print("\ntiny-llama float32, 512-token prompt")
    print("bits  attn rel err (per layer)  next-token agreement (all TQ / last layer dense)")
    for bits in (2, 3, 4, 8):
        err = attention_error(model, tokens, bits)
        a_all = next_token_agreement(model, tokens, bits)
        a_last = next_token_agreement(model, tokens, bits, dense_layers=(-1,))
        print(f"{bits:>4}  {' '.join(f'{e:.4f}' for e in err):>24}  {a_all:.3f} / {a_last:.3f}")

    if not args.skip_tiny_timing:
        timings("tiny-llama float32", model, (512, 2048) if args.quick else (512, 2048, 8192), (1, 3))
    print("\nthe bundled trained model (SmolLM2-135M): python bench/bench_turboquant.py --smollm2")


if __name__ == "__main__":
    main()

"""What left padding costs one batched decode step of a whole model, where that time goes, and
what the start-offset kernel gives back.

B rows of `--context` tokens in a `RowBatchKVCache` (equal lengths), against rows of
lengths context, context - 37, ... (left-padded; a smaller gap for short contexts), per full-model decode step:

* equal: no padding, mask None (MLX's fused SDPA);
* padded, masked: MLX's SDPA with the boolean padding mask (PREFIXTRACE_DECODE_ATTENTION=0);
* padded, kernel: engine/decode_attention.py's split-K kernel taking each row's start
  offset (CUDA only; the attention hook installed as the engine installs it), at every
  `--dense-shape` (target blocks x unroll: `decode_attention.dense_shape`);
* equal, kernel: the same kernel on the equal rows (mode "all"): the kernel against MLX's
  fused SDPA on the same K/V;
* `--dense-variants v1,mma[,mma-uN]`: each dense kernel (v1: session 4's CUDA-core kernel; mma:
  engine/dense_mma.py) side by side in one process, keys tagged `_mma` / `_v1` past the default;
* copy (`--attention copy` or `both`): every attention call replaced by its query (the same
  output shape; the cache update still runs, its arrays are evaluated with the logits), so
  what is left is the step outside attention, equal vs padded.

Every figure is the median of `--repeats` steps after 3 discarded ones, and each context first
times one throw-away equal step (session 6: the first timing of a shape ran ~1.8x slow).
`build_ms` beside each: the Python part (the model call that builds the graph, before
`mx.eval`), the rest is evaluation; `pipelined_ms`: steps built while the previous one
evaluates, as `GenerationBatch` runs them (the engine's figure: Python hidden behind the device). `--attention-only`: per call, the attention of every
layer's cache in one evaluation (no Python between launches): kernel against fused SDPA
without the rest of the step. `--generation-batch N`: mlx-lm's `GenerationBatch` at B rows
of 16.. tokens, padded vs equal (bench/bench_scheduler.py's `steady_batch_decode`), tokens/s.

Target (issue 17): padded within 10% of equal.

    python bench/bench_decode_mask.py --random qwen3-8b --context 4096 --context 32768 --repeats 12 \\
        --attention both --attention-only --dense-shape 1024x4 --dense-shape 2048x4 --dense-shape 4096x4 \\
        --dense-shape 1024x8 --generation-batch 64                                      # GPU
    python bench/bench_decode_mask.py --random qwen3-8b --context 4096 --context 32768 --repeats 12 \\
        --attention both --attention-only --dense-variants v1,mma                      # GPU, session 8
    python bench/bench_decode_mask.py --attention both --attention-only                  # CPU, tiny fixture
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_lm.models.cache import KVCache  # noqa: E402

from bench.bench_scheduler import QWEN3_8B, random_loader, steady_batch_decode  # noqa: E402
from engine import decode_attention, dense_mma, dense_prebuild  # noqa: E402
from engine.batch_cache import RowBatchKVCache  # noqa: E402
from engine.attention_hook import install_attention_hook  # noqa: E402


def step_ms(model, cache, tokens, repeats: int) -> tuple[float, float]:
    """Medians (ms) of a full decode step and of its graph-building part; each step's token
    is trimmed off again so the lengths (and padding) stay as built. The cache's arrays are
    evaluated with the logits (free when attention reads them, needed when `copy` does not)."""
    times, builds = [], []
    for i in range(repeats + 3):
        t0 = time.perf_counter()
        logits = model(tokens, cache=cache)
        t1 = time.perf_counter()
        mx.eval(logits, [(c.keys, c.values) for c in cache])
        if i >= 3:
            times.append(time.perf_counter() - t0)
            builds.append(t1 - t0)
        del logits
        for c in cache:
            c.trim(1)
    return 1000 * statistics.median(times), 1000 * statistics.median(builds)


def pipelined_ms(model, cache, tokens, repeats: int) -> float:
    """Mean ms per step when each step's graph is built while the previous one evaluates, as
    mlx-lm's `GenerationBatch` runs (`mx.async_eval` of step n+1, then waiting on step n): the
    Python of a step is hidden wherever the device takes longer."""
    def one():
        logits = model(tokens, cache=cache)
        mx.async_eval(logits, [(c.keys, c.values) for c in cache])
        for c in cache:
            c.trim(1)
        return logits

    prev = one()
    for _ in range(2):  # warm-up, not timed
        cur = one()
        mx.eval(prev)
        prev = cur
    mx.eval(prev)
    t0 = time.perf_counter()
    prev = one()
    for _ in range(repeats - 1):
        cur = one()
        mx.eval(prev)
        prev = cur
    mx.eval(prev)
    return 1000 * (time.perf_counter() - t0) / repeats


def step_logits(model, cache, tokens, mode: str) -> mx.array:
    """One step's float32 logits (trimmed off again), attention in `mode`."""
    decode_attention.set_mode(mode)
    try:
        logits = model(tokens, cache=cache)[:, -1].astype(mx.float32)
        mx.eval(logits)
    finally:
        decode_attention.set_mode("on")
    for c in cache:
        c.trim(1)
    return logits


def agreement(got: mx.array, ref: mx.array) -> dict:
    """How far the kernel step's logits are from the masked-SDPA step's (bf16 model)."""
    err = (mx.abs(got - ref).max() / mx.abs(ref).max()).item()
    same = (mx.argmax(got, axis=-1) == mx.argmax(ref, axis=-1)).astype(mx.float32).mean().item()
    return {"max_rel_err": round(err, 5), "argmax_agree": round(same, 3)}


def _copy_attention(queries, keys, values, cache, scale, mask, sinks=None):
    return queries  # (B, q_heads, 1, D): attention's output shape, no work


@contextmanager
def attention_replaced(model, fn):
    """Every model module's `scaled_dot_product_attention` (the hooked one) replaced by `fn`."""
    modules = {type(m).__module__ for _, m in model.named_modules()}
    saved = {}
    for name in modules:
        module = sys.modules.get(name)
        if getattr(module, "scaled_dot_product_attention", None) is not None:
            saved[name] = module.scaled_dot_product_attention
            module.scaled_dot_product_attention = fn
    try:
        yield
    finally:
        for name, f in saved.items():
            sys.modules[name].scaled_dot_product_attention = f


def batch_cache(model, lengths: list[int]) -> list:
    args = model.args
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    layers = []
    for _ in model.layers:
        rows = []
        for n in lengths:
            c = KVCache()
            kv = mx.random.normal((1, args.num_key_value_heads, n, dim)).astype(mx.bfloat16)
            c.update_and_fetch(kv, kv)
            rows.append(c)
        layers.append(RowBatchKVCache.merge(rows))
        mx.eval(layers[-1].keys, layers[-1].values)
    return layers


def attention_only_us(model, cache, how: str, repeats: int) -> float:
    """Median us per attention call: one query per row against every layer's cache, all
    layers' calls evaluated together (no Python or other ops between the launches).
    how: "sdpa" (mask None), "masked" (the cache's padding mask), "kernel" (dense_attend)."""
    args = model.args
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    B = cache[0].keys.shape[0]
    q = mx.random.normal((B, args.num_attention_heads, 1, dim)).astype(mx.bfloat16)
    mx.eval(q)
    scale = dim ** -0.5
    mask = cache[0].make_mask(1, return_array=True) if how == "masked" else None
    if mask is not None:
        mask = mask[..., :-1]  # make_mask counts the token a step would add: these keys are one fewer
        mx.eval(mask)
    times = []
    for i in range(repeats + 2):
        outs = []
        t0 = time.perf_counter()
        for c in cache:
            k, v = c.keys_and_values()
            if how == "kernel":
                outs.append(decode_attention.dense_attend(q, k, v, c.left_padding, scale))
            else:
                outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
        mx.eval(outs)
        if i >= 2:
            times.append((time.perf_counter() - t0) / len(cache))
    return 1e6 * statistics.median(times)


def _shape(spec: str) -> tuple[int, int]:
    blocks, unroll = spec.lower().split("x")
    return int(blocks), int(unroll)


def _variant(spec: str) -> tuple[str, int]:
    """"v1", "mma" or "mma-uN" (the MMA kernel at unroll N) -> (variant, MMA unroll)."""
    name, _, u = spec.partition("-u")
    if name not in decode_attention.DENSE_VARIANTS or (u and int(u) not in dense_mma.UNROLLS):
        raise SystemExit(f"--dense-variants: {spec!r} is not v1, mma or mma-uN (N in {dense_mma.UNROLLS})")
    return name, int(u) if u else dense_mma.U


@contextmanager
def dense_kernel(variant: tuple[str, int], shape: tuple[int, int]):
    """The dense kernel's variant and launch shape for the duration (restored after)."""
    saved = decode_attention.dense_variant(), dense_mma.unroll(), decode_attention.dense_shape()
    decode_attention.set_dense_variant(variant[0])
    dense_mma.set_unroll(variant[1])
    decode_attention.set_dense_shape(*shape)
    try:
        yield
    finally:
        decode_attention.set_dense_variant(saved[0])
        dense_mma.set_unroll(saved[1])
        decode_attention.set_dense_shape(*saved[2])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--random", choices=["qwen3-8b"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, action="append")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--attention", choices=["real", "copy", "both"], default="real",
                        help="copy: each attention call replaced by its query (the step outside attention)")
    parser.add_argument("--attention-only", action="store_true", help="also time attention calls alone")
    parser.add_argument("--dense-shape", action="append", default=[],
                        help="BLOCKSxUNROLL of the dense kernel to time padded rows at (default: the current one)")
    parser.add_argument("--dense-variants", default="",
                        help="comma-separated dense kernels to time side by side: v1, mma, mma-uN (default: "
                             "the current one); each beside the others at every --dense-shape")
    parser.add_argument("--generation-batch", type=int, default=0, metavar="TOKENS",
                        help="also mlx-lm's GenerationBatch, padded vs equal rows, this many tokens")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.random:
        model, _, _ = random_loader(QWEN3_8B)()
    else:
        from mlx_lm.utils import load

        model, _ = load(str(ROOT / "fixtures" / "tiny-llama"))
        model.set_dtype(mx.bfloat16)
    install_attention_hook(model)
    kernel = decode_attention.available()
    shapes = [_shape(s) for s in args.dense_shape] or [decode_attention.dense_shape()]
    default_shape = decode_attention.dense_shape()
    default_variant = (decode_attention.dense_variant(), dense_mma.unroll())
    variants = [_variant(v) for v in args.dense_variants.split(",") if v] or [default_variant]

    def tag_of(variant, shape=None) -> str:
        """"" for the current kernel at the current shape, else _mma[_uN] / _v1 and _BLOCKSxUNROLL."""
        parts = []
        if variant != default_variant:
            parts.append(variant[0] + (f"_u{variant[1]}" if variant[0] == "mma" and variant[1] != dense_mma.U else ""))
        if shape is not None and shape != default_shape:
            parts.append(f"{shape[0]}x{shape[1]}")
        return "".join("_" + p for p in parts)

    configs = [(v, sh) for v in variants for sh in shapes]
    tokens = mx.zeros((args.batch, 1), dtype=mx.int32)
    out = {"device": str(mx.default_device()), "batch": args.batch, "repeats": args.repeats, "runs": []}
    if kernel:  # each variant's chunk instances as an engine builds them at load (engine/dense_prebuild.py)
        out["prebuild_s"] = {}
        for variant in variants:
            with dense_kernel(variant, default_shape):
                t0 = time.perf_counter()
                built = dense_prebuild.prebuild(model, args.batch)
                out["prebuild_s"][tag_of(variant) or "default"] = {"total": round(time.perf_counter() - t0, 3),
                                                                    **{str(c): round(x, 3) for c, x in built.items()}}
        print(json.dumps({"prebuild_s": out["prebuild_s"]}), flush=True)

    def save():
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))

    for context in args.context or [512]:
        row = {"context": context}
        equal = batch_cache(model, [context] * args.batch)
        gap = max(1, min(37, context // (2 * args.batch)))
        padded = batch_cache(model, [context - gap * i for i in range(args.batch)])

        def timed(name, cache, mode="on"):
            decode_attention.set_mode(mode)
            try:
                row[name + "_ms"], row[name + "_build_ms"] = (round(x, 3) for x in step_ms(model, cache, tokens,
                                                                                           args.repeats))
                row[name + "_pipelined_ms"] = round(pipelined_ms(model, cache, tokens, args.repeats), 3)
            finally:
                decode_attention.set_mode("on")

        timed("warmup_equal", equal, "off")  # discarded (the first timing of a shape runs slow)
        for k in [k for k in row if k.startswith("warmup_")]:
            del row[k]
        if args.attention in ("real", "both"):
            timed("equal", equal, "off")
            timed("padded_masked", padded, "off")
            row["padded_masked_vs_equal"] = round(row["padded_masked_ms"] / row["equal_ms"], 3)
            row["padded_masked_pipelined_vs_equal"] = round(row["padded_masked_pipelined_ms"]
                                                            / row["equal_pipelined_ms"], 3)
            if kernel:
                ref = step_logits(model, padded, tokens, "off")
                for variant, shape in configs:
                    tag = tag_of(variant, shape)
                    with dense_kernel(variant, shape):
                        row[f"padded_kernel{tag}_check"] = agreement(step_logits(model, padded, tokens, "on"), ref)
                        timed("padded_kernel" + tag, padded)
                    row[f"padded_kernel{tag}_vs_equal"] = round(row[f"padded_kernel{tag}_ms"] / row["equal_ms"], 3)
                    row[f"padded_kernel{tag}_pipelined_vs_equal"] = round(
                        row[f"padded_kernel{tag}_pipelined_ms"] / row["equal_pipelined_ms"], 3)
                for variant in variants:  # each kernel on the equal rows too (mode "all"): against fused SDPA
                    tag = tag_of(variant)
                    with dense_kernel(variant, default_shape):
                        timed("equal_kernel" + tag, equal, "all")
                    row[f"equal_kernel{tag}_vs_equal"] = round(row[f"equal_kernel{tag}_ms"] / row["equal_ms"], 3)
            timed("equal_again", equal, "off")  # the baseline's spread within this row
        if args.attention in ("copy", "both"):
            with attention_replaced(model, _copy_attention):
                timed("equal_copy", equal)
                timed("padded_copy", padded)
            row["padded_copy_vs_equal_copy"] = round(row["padded_copy_ms"] / row["equal_copy_ms"], 3)
            row["padded_copy_pipelined_vs_equal_copy"] = round(row["padded_copy_pipelined_ms"]
                                                               / row["equal_copy_pipelined_ms"], 3)
        if args.attention_only:
            row["attn_equal_sdpa_us"] = round(attention_only_us(model, equal, "sdpa", args.repeats), 2)
            row["attn_padded_masked_us"] = round(attention_only_us(model, padded, "masked", args.repeats), 2)
            if kernel:
                for variant, shape in configs:
                    tag = tag_of(variant, shape)
                    with dense_kernel(variant, shape):
                        row[f"attn_padded_kernel{tag}_us"] = round(attention_only_us(model, padded, "kernel",
                                                                                     args.repeats), 2)
                    row[f"attn_padded_kernel{tag}_vs_sdpa"] = round(row[f"attn_padded_kernel{tag}_us"]
                                                                    / row["attn_equal_sdpa_us"], 3)
                for variant in variants:
                    tag = tag_of(variant)
                    with dense_kernel(variant, default_shape):
                        row[f"attn_equal_kernel{tag}_us"] = round(attention_only_us(model, equal, "kernel",
                                                                                    args.repeats), 2)
                row["attn_equal_sdpa_again_us"] = round(attention_only_us(model, equal, "sdpa", args.repeats), 2)
        out["runs"].append(row)
        print(json.dumps(row), flush=True)
        save()
        del equal, padded
        mx.clear_cache()
    if args.generation_batch:
        vocab = model.args.vocab_size
        gen = {"tokens": args.generation_batch}
        steady_batch_decode(model, args.batch, 8, vocab)  # warm-up, discarded
        for name, padded_rows, mode in (("equal", False, "on"), ("padded_masked", True, "off"),
                                        ("padded_kernel", True, "on"), ("equal_again", False, "on")):
            decode_attention.set_mode(mode)
            gen[name + "_tok_s"] = round(steady_batch_decode(model, args.batch, args.generation_batch, vocab,
                                                             padded_rows), 1)
        decode_attention.set_mode("on")
        for name in ("padded_masked", "padded_kernel"):
            gen[name + "_vs_equal"] = round(gen["equal_tok_s"] / gen[name + "_tok_s"], 3)  # time ratio
        out["generation_batch"] = gen
        print(json.dumps(gen), flush=True)
    save()


if __name__ == "__main__":
    main()

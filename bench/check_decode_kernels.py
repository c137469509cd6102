"""GPU check of engine/decode_attention.py's kernels against the reference paths; exits 1 on a mismatch.

    python bench/check_decode_kernels.py [--long] [--variants v2,v2s,v1] [--skip-dense] [--json out.json]
    python bench/check_decode_kernels.py --only-dense --dense-variants v1,mma --long   # the dense kernels alone

* dense: `dense_attend` over left-padded `RowBatchKVCache` rows (strided views of the
  cache's buffer, as the model hands them) against MLX's masked SDPA on the same K/V in
  float32; float32 / bf16 / fp16, GQA 1-8, head dims 64 / 128 (and 16, the fixture's); per
  `--dense-variants` (mma: engine/dense_mma.py, its cases record `mma_launches`, 0 where it
  hands the step to v1: float32, head dim 16);
* TurboQuant: `cache.attend` through the kernel against SDPA over the decoded cache
  (what `update_and_fetch` returns), one row and left-padded batches, 2 / 4 / 8 bits, per
  decode variant (v3: v2s's step with the session-6 kernel, also at narrower code loads; v2: deferred
  encode + one launch; v2s: two launches; v1: session 4's);
* greedy tokens on fixtures/tiny-llama (float32; --greedy-dtypes adds bfloat16, the only dtype
  v4 takes: float32 runs v3 under v4): TurboQuant with the kernel against the
  MLX-ops path over a long generation, one row and a left-padded batch of three (whose
  dense last layer takes the dense kernel), and a dense padded batch.
* v4 (engine/tq_mma.py): its cases record `v4_launches`, the v4 steps launched in the case
  (0 where the step is one v4 hands to v3: float32, 2 / 8 bits); v5 the same (its v5 steps), and
  two short cases again with its fold switched (`tq_mma.fold5`), so both of its kernels run; v7
  (engine/tq_fused.py) the same, and `v7_launches`: its own kernel's steps (0 where it hands the
  step to v5: D = 256, float32, 2 / 8 bits).

Tolerances: float32 1e-4 absolute (the CPU tests' tolerance for the same comparison);
bf16 / fp16 outputs are rounded to their dtype, so 2e-2 / 4e-3 of the output's scale.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_lm.models.cache import KVCache  # noqa: E402

from engine import decode_attention, dense_mma, tq_fused, tq_mma  # noqa: E402
from engine.batch_cache import RowBatchKVCache  # noqa: E402
from engine.tq_cache import BatchTurboQuantKVCache, TurboQuantKVCache  # noqa: E402

TOL = {mx.float32: 1e-4, mx.bfloat16: 2e-2, mx.float16: 4e-3}
results: list[dict] = []


def record(kind: str, ok: bool, **info) -> None:
    results.append({"check": kind, "ok": bool(ok), **info})
    print(json.dumps(results[-1]), flush=True)


def err(got: mx.array, ref: mx.array) -> tuple[float, float]:
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    return mx.abs(got - ref).max().item(), mx.abs(ref).max().item()


def within(e: float, scale: float, dtype) -> bool:
    return e <= TOL[dtype] * (1.0 if dtype == mx.float32 else max(scale, 1.0))


def dense_case(lengths: list[int], q_heads: int, kv_heads: int, dim: int, dtype, variant: str = "v1") -> None:
    decode_attention.set_dense_variant(variant)
    mx.random.seed(sum(lengths) + dim)
    rows = []
    for n in lengths:
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, kv_heads, n, dim)).astype(dtype),
                           mx.random.normal((1, kv_heads, n, dim)).astype(dtype))
        rows.append(c)
    batch = RowBatchKVCache.merge(rows)
    mask = batch.make_mask(1)
    B = len(lengths)
    keys, values = batch.update_and_fetch(mx.random.normal((B, kv_heads, 1, dim)).astype(dtype),
                                          mx.random.normal((B, kv_heads, 1, dim)).astype(dtype))
    q = mx.random.normal((B, q_heads, 1, dim)).astype(dtype)
    scale = dim ** -0.5
    assert decode_attention.use_dense(batch, q, keys, mask if mask is not None else "x")
    launched = dense_mma.launches[0]
    got = decode_attention.dense_attend(q, keys, values, batch.left_padding, scale)
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys.astype(mx.float32),
                                               values.astype(mx.float32), scale=scale, mask=mask)
    e, s = err(got, ref)
    mma = dense_mma.launches[0] - launched
    # the MMA kernel must have run (not handed the step to v1) wherever it maps the shape
    mma_ok = variant != "mma" or mma == int(dense_mma.usable(q, keys, q_heads // kv_heads))
    record("dense", within(e, s, dtype) and mma_ok, variant=variant, lengths=lengths[:4], rows=B,
           heads=[q_heads, kv_heads], dim=dim, dtype=str(dtype), max_err=e, scale=s,
           **({"mma_launches": mma} if variant == "mma" else {}))
    decode_attention.set_dense_variant(decode_attention.DEFAULT_DENSE_VARIANT)


def tq_case(chunks_per_row: list[list[int]], q_heads: int, kv_heads: int, dim: int, bits: int, dtype,
            group: int = 64, variant: str = "v2s", steps: int = 3, unroll: int = 4, load: int | None = None) -> None:
    load = load or decode_attention.DEFAULT_TQ3_LOAD
    decode_attention.set_tq_variant(variant)
    decode_attention.set_tq_unroll(unroll)
    decode_attention.set_tq3_load(load)
    mx.random.seed(bits * 1000 + dim + len(chunks_per_row))
    rows = []
    for chunks in chunks_per_row:
        c = TurboQuantKVCache(kv_bits=bits, group=group)
        for n in [m for m in chunks if m]:  # (a 0-token call would encode an empty array)
            c.update_and_fetch(mx.random.normal((1, kv_heads, n, dim)).astype(dtype),
                               mx.random.normal((1, kv_heads, n, dim)).astype(dtype))
        rows.append(c)
    cache = rows[0] if len(rows) == 1 else BatchTurboQuantKVCache.merge(rows)
    B = len(rows)
    mask = cache.make_mask(1) if B > 1 else None
    launched = tq_mma.launches[0] + sum(tq_mma.launches5)
    launched7 = tq_fused.launches7[0]
    for step in range(steps):  # consecutive decode steps (the dense window shifts, deferred codes land)
        keys, values = cache.update_and_fetch(mx.random.normal((B, kv_heads, 1, dim)).astype(dtype),
                                              mx.random.normal((B, kv_heads, 1, dim)).astype(dtype))
        q = mx.random.normal((B, q_heads, 1, dim)).astype(dtype)
        scale = dim ** -0.5
        assert decode_attention.use_tq(q, kv_heads, bits, dim)
        got = cache.attend(q, scale, mask)
        ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys.astype(mx.float32),
                                                   values.astype(mx.float32), scale=scale, mask=mask)
        e, s = err(got, ref)
        # v4 / v5 must have run (not handed the step to v3) wherever they map the shape
        ran = tq_mma.launches[0] + sum(tq_mma.launches5) + tq_fused.launches7[0] - launched - launched7
        v4_ok = (variant not in ("v4", "v5", "v7") or dtype == mx.float32 or bits != 4 or dim not in tq_mma.DIMS4
                 or ran == step + 1)
        # v7 must have run its own kernel (not handed the step to v5) wherever it maps the shape
        ran7 = tq_fused.launches7[0] - launched7
        v7_ok = variant != "v7" or ran7 == (step + 1 if tq_fused.usable7(q, bits, q_heads // kv_heads, dim, group) else 0)
        record("turboquant", within(e, s, dtype) and v4_ok and v7_ok, variant=variant, unroll=unroll, load=load, rows=B,
               lengths=[sum(c) for c in chunks_per_row][:4], heads=[q_heads, kv_heads], dim=dim, bits=bits,
               dtype=str(dtype), step=step, max_err=e, scale=s,
               **({"v4_launches": ran} if variant in ("v4", "v5", "v7") else {}),
               **({"v7_launches": ran7} if variant == "v7" else {}))
        if B > 1:
            mask = cache.make_mask(1)


def _greedy(model, make_caches, prompts: list[list[int]], steps: int) -> list[list[int]]:
    per_row = []
    for p in prompts:
        cache = make_caches()
        for a in range(0, len(p) - 1, 64):  # the engine test's prefill chunking
            model(mx.array([p[a : min(a + 64, len(p) - 1)]]), cache=cache)
        per_row.append(cache)
    if len(prompts) == 1:
        cache = per_row[0]
    else:
        cache = [RowBatchKVCache.merge([r[i] for r in per_row]) if type(per_row[0][i]) is KVCache
                 else per_row[0][i].merge([r[i] for r in per_row]) for i in range(len(per_row[0]))]
    tokens = mx.array([[p[-1]] for p in prompts])
    out = [[] for _ in prompts]
    for _ in range(steps):
        tokens = mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)[:, None]
        for i, t in enumerate(tokens[:, 0].tolist()):
            out[i].append(t)
    return out


def wide_model(dtype: str):
    """The fixture's recipe (random Llama weights at gain 3: chaotic enough that greedy tokens vary)
    at a head shape v4 maps: head dim 128, 8 query / 2 KV heads (G = 4), 3 layers (two TurboQuant,
    the last dense). fixtures/tiny-llama's head dim 16 is one v4 hands to v3."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=3, intermediate_size=512,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-5,
                           vocab_size=508, rope_theta=10000.0, tie_word_embeddings=True)
    model = llama.Model(args)
    mx.random.seed(0)
    weights = []
    for name, p in tree_flatten(model.parameters()):
        if "embed_tokens" in name:
            weights.append((name, mx.random.normal(p.shape) * 0.5))
        elif p.ndim == 2:
            weights.append((name, mx.random.normal(p.shape) * (3.0 / p.shape[-1] ** 0.5)))
        else:
            weights.append((name, mx.ones(p.shape)))
    model.load_weights(weights)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def greedy_identity(steps: int, variants=("v2s",), dense: bool = True, dtype: str = "float32",
                    model_name: str = "tiny") -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from engine.model_files import load_model_dir
    from engine.tq_config import make_tq_cache
    from engine.attention_hook import install_attention_hook

    if model_name == "wide":
        model = wide_model(dtype)
    else:
        model, _, _ = load_model_dir(ROOT / "fixtures" / "tiny-llama", dtype)
    install_attention_hook(model)
    single = [[(i * 37 + 11) % 500 + 3 for i in range(300)]]
    batch = [[(i * 13 + 5) % 500 + 3 for i in range(n)] for n in (190, 17, 75)]
    cases = [(f"tq_single_{v}", v, lambda: make_tq_cache(model, bits=4), single) for v in variants]
    cases += [(f"tq_padded_batch_{v}", v, lambda: make_tq_cache(model, bits=4), batch) for v in variants]
    if dense:
        cases.append(("dense_padded_batch", "v2s", lambda: make_prompt_cache(model), batch))
    refs = {}
    for name, variant, make, prompts in cases:
        decode_attention.set_tq_variant(variant)
        key = (name.startswith("tq"), len(prompts))
        if key not in refs:  # the MLX-ops path does not depend on the variant
            decode_attention.set_mode("off")
            refs[key] = _greedy(model, make, prompts, steps)
        ref = refs[key]
        decode_attention.set_mode("on")
        got = _greedy(model, make, prompts, steps)
        same = [a == b for a, b in zip(got, ref)]
        first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, ref)]
        # float32: identical tokens required. bf16: recorded, not required: there even v3 (f32
        # arithmetic) leaves the MLX-ops path (bf16 decoded K/V) within a few tokens on this
        # chaotic random model (the CPU emulation's run), so identity measures rounding there.
        record("greedy_" + name, all(same) or dtype != "float32", identical=all(same), steps=steps, rows=len(prompts), first_difference=first, dtype=dtype,
               model=model_name)
    decode_attention.set_tq_variant("v2s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", action="store_true", help="also 32k / 100k contexts")
    ap.add_argument("--long-variants", help="variants of the --long cases (default: --variants)")
    ap.add_argument("--steps", type=int, default=400, help="greedy tokens compared on the fixture")
    ap.add_argument("--variants", default="v3,v2s,v2,v1",
                    help="TurboQuant decode variants to check (engine.decode_attention.TQ_VARIANTS)")
    ap.add_argument("--skip-dense", action="store_true", help="leave out the dense kernel's cases")
    ap.add_argument("--unrolls", default="8,16", help="v2s with these tq_unroll values too (empty: none)")
    ap.add_argument("--tq3-loads", default="16,4", help="v3 with these tq3_load widths too (empty: none)")
    ap.add_argument("--greedy-variants", help="variants of the greedy-token identity (default: --variants)")
    ap.add_argument("--greedy-dtypes", default="float32", help="model dtypes of the greedy-token identity")
    ap.add_argument("--greedy-wide", default="",
                    help="also the greedy identity on `wide_model` (head dim 128: v4 maps it) at these dtypes")
    ap.add_argument("--only-long", action="store_true",
                    help="leave out the short cases and the fixture's greedy part (with --long / --greedy-wide)")
    ap.add_argument("--dense-variants", default="mma,v1",
                    help="dense kernel variants to check (engine.decode_attention.DENSE_VARIANTS; mma the default)")
    ap.add_argument("--only-dense", action="store_true",
                    help="the dense cases alone (with --long: the padded long rows too) and the dense greedy part")
    ap.add_argument("--mapped-only", action="store_true",
                    help="of the short cases, only the bf16 / f16 ones v4 / v5 map (not the generic loop's)")
    ap.add_argument("--mapped-dtypes", default="bfloat16,float16", help="dtypes of the short cases v4 / v5 / v7 map")
    ap.add_argument("--mapped-cases", default="row,g1,d256,d64,b8,pad",
                    help="which of those cases: row (one row of 4,033 over 70 steps), g1, d256, d64 (G = 3), b8 (G = 8), "
                    "pad (four left-padded rows, G = 4)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    variants = args.variants.split(",")
    unrolls = [int(u) for u in args.unrolls.split(",") if u]
    loads = [int(u) for u in args.tq3_loads.split(",") if u] if "v3" in variants else []
    if not decode_attention.available():
        print("no CUDA device: nothing to check (the kernels are CUDA only)")
        return 0
    t0 = time.perf_counter()
    dense_variants = [v for v in args.dense_variants.split(",") if v] if not args.skip_dense else []
    if args.only_dense:  # no TurboQuant case anywhere
        variants, unrolls, loads = [], [], []
    for dv in dense_variants if not args.only_long else ():
        for dtype in (mx.float32, mx.bfloat16):
            dense_case([100], 32, 8, 128, dtype, dv)
            dense_case([1000, 963, 100, 1], 32, 8, 128, dtype, dv)
            dense_case([4097, 4000, 2500, 17, 4097, 64, 65, 3000], 32, 8, 128, dtype, dv)
            dense_case([300, 250, 10], 9, 3, 64, dtype, dv)  # SmolLM2: G = 3
            dense_case([70, 5], 4, 2, 16, dtype, dv)  # the fixture
        dense_case([500, 20], 8, 8, 128, mx.float16, dv)  # no GQA
        dense_case([800, 300], 64, 8, 128, mx.bfloat16, dv)  # G = 8
        if dv == "mma":  # what the MMA kernel maps beyond the above: f16, D 256, G 1, every unroll
            dense_case([4097, 4000, 2500, 17, 4097, 64, 65, 3000], 32, 8, 128, mx.float16, dv)
            dense_case([600, 31, 1], 16, 4, 256, mx.bfloat16, dv)
            dense_case([513, 2], 8, 8, 128, mx.float16, dv)
            for u in dense_mma.UNROLLS:
                dense_mma.set_unroll(u)
                dense_case([4097, 4000, 2500, 17, 4097, 64, 65, 3000], 32, 8, 128, mx.bfloat16, dv)
                dense_case([300, 250, 10], 9, 3, 64, mx.bfloat16, dv)
            dense_mma.set_unroll(dense_mma.U)
    for variant in variants if not (args.only_long or args.mapped_only) else ():
        # v2 defers codes to the step a row first sees them decoded: runs of steps that cross
        # group boundaries (20 steps at group 16, 70 at 64 for the long row).
        for dtype in (mx.float32, mx.bfloat16):
            tq_case([[200, 9]], 32, 8, 128, 4, dtype, variant=variant)
            tq_case([[4000, 33]], 32, 8, 128, 4, dtype, variant=variant, steps=70 if dtype == mx.float32 else 3)
            tq_case([[300], [7, 30, 1], [64], [1000, 3]], 32, 8, 128, 4, dtype, variant=variant)
            tq_case([[150, 10], [70]], 9, 3, 64, 4, dtype, variant=variant)
            tq_case([[100, 7], [20]], 4, 2, 16, 4, dtype, group=16, variant=variant, steps=20)
        for bits in (2, 8):
            tq_case([[300], [7, 30, 1]], 32, 8, 128, bits, mx.float32, group=16, variant=variant, steps=20)
        tq_case([[64 * 7, 1]] * 8, 64, 8, 128, 4, mx.bfloat16, variant=variant)  # B = 8, G = 8
        tq_case([[500, 3], [64]], 8, 8, 128, 4, mx.float32, variant=variant, steps=20)  # G = 1
    for v in [v for v in ("v4", "v5", "v7") if v in variants and not args.only_long]:
        # what v4 / v5 map, bf16 / f16 at 4 bits (the loop above: its float32 cases run v3)
        for dtype in [getattr(mx, d) for d in args.mapped_dtypes.split(",") if d]:
            cases = {"row": lambda: tq_case([[4000, 33]], 32, 8, 128, 4, dtype, variant=v, steps=70),
                     "g1": lambda: tq_case([[500, 3], [64]], 8, 8, 128, 4, dtype, variant=v, steps=20),  # G = 1
                     "d256": lambda: tq_case([[300], [7, 30, 1], [64], [1000, 3]], 16, 4, 256, 4, dtype, variant=v),
                     "d64": lambda: tq_case([[150, 10], [70]], 9, 3, 64, 4, dtype, variant=v, steps=20),  # G = 3
                     "b8": lambda: tq_case([[64 * 7, 1]] * 8, 64, 8, 128, 4, dtype, variant=v, steps=20),  # G = 8
                     # four left-padded rows at the Qwen3-8B shape, across group boundaries
                     "pad": lambda: tq_case([[300], [7, 30, 1], [64], [1000, 3]], 32, 8, 128, 4, dtype, variant=v,
                                            steps=20)}
            for name in args.mapped_cases.split(","):
                cases[name]()
        if v == "v5":  # both of v5's kernels on the same shapes: again with the fold switched (`fold5`)
            saved = tq_mma.fold5()
            tq_mma.set_fold5(not saved)
            tq_case([[4000, 33]], 32, 8, 128, 4, mx.bfloat16, variant=v, steps=70)
            tq_case([[300], [7, 30, 1], [64], [1000, 3]], 32, 8, 128, 4, mx.bfloat16, variant=v, steps=20)
            tq_mma.set_fold5(saved)
    for load in loads:  # v3 with narrower code loads per lane (more blocks per SM)
        for dtype in (mx.float32, mx.bfloat16):
            tq_case([[4000, 33]], 32, 8, 128, 4, dtype, variant="v3", load=load, steps=70 if dtype == mx.float32 else 3)
            tq_case([[300], [7, 30, 1], [64], [1000, 3]], 32, 8, 128, 4, dtype, variant="v3", load=load)
        tq_case([[150, 10], [70]], 9, 3, 64, 4, mx.float32, variant="v3", load=load)
        tq_case([[100, 7], [20]], 4, 2, 16, 4, mx.float32, group=16, variant="v3", load=load, steps=20)
        tq_case([[300], [7, 30, 1]], 32, 8, 128, 2, mx.float32, group=16, variant="v3", load=load, steps=20)
        tq_case([[64 * 7, 1]] * 8, 64, 8, 128, 4, mx.bfloat16, variant="v3", load=load)
    for unroll in unrolls:  # more tokens per lane group per loop step (v2s)
        tq_case([[4000, 33]], 32, 8, 128, 4, mx.bfloat16, unroll=unroll)
        tq_case([[300], [7, 30, 1], [64], [1000, 3]], 32, 8, 128, 4, mx.float32, unroll=unroll)
        tq_case([[100, 7], [20]], 4, 2, 16, 4, mx.float32, group=16, unroll=unroll, steps=20)
        tq_case([[64 * 7, 1]] * 8, 64, 8, 128, 4, mx.bfloat16, unroll=unroll)
    decode_attention.set_tq_unroll(4)
    decode_attention.set_tq3_load(decode_attention.DEFAULT_TQ3_LOAD)
    for i, dtype in enumerate([d for d in args.greedy_dtypes.split(",") if d] if not args.only_long else ()):
        greedy_identity(args.steps, args.greedy_variants.split(",") if args.greedy_variants else variants,
                        dense=not args.skip_dense and i == 0, dtype=dtype)
    if "mma" in dense_variants and not args.only_long:
        # the wide model (head dim 128) in bf16: the MMA kernel takes its padded dense steps
        decode_attention.set_dense_variant("mma")
        launched = dense_mma.launches[0]
        greedy_identity(args.steps, (), dense=True, dtype="bfloat16", model_name="wide")
        record("greedy_mma_launched", dense_mma.launches[0] > launched, launches=dense_mma.launches[0] - launched)
        decode_attention.set_dense_variant(decode_attention.DEFAULT_DENSE_VARIANT)
    for dtype in [d for d in args.greedy_wide.split(",") if d]:
        greedy_identity(args.steps, args.greedy_variants.split(",") if args.greedy_variants else variants,
                        dense=False, dtype=dtype, model_name="wide")
    long_variants = args.long_variants.split(",") if args.long_variants else variants
    if args.long:
        for n in (32768, 100000):
            for dv in dense_variants:
                dense_case([n, n - 5000, 77], 32, 8, 128, mx.bfloat16, dv)
                # B = 8 left-padded rows at this context (bench_decode_mask's padded shape)
                dense_case([n - 37 * i for i in range(8)], 32, 8, 128, mx.bfloat16, dv)
            for variant in long_variants:
                tq_case([[8192] * (n // 8192) + [n % 8192]], 32, 8, 128, 4, mx.bfloat16, variant=variant)
            for unroll in unrolls:
                tq_case([[8192] * (n // 8192) + [n % 8192]], 32, 8, 128, 4, mx.bfloat16, unroll=unroll)
            for load in loads:
                tq_case([[8192] * (n // 8192) + [n % 8192]], 32, 8, 128, 4, mx.bfloat16, variant="v3", load=load)
            # four left-padded rows, the longest at this context
            for variant in [v for v in long_variants if v in ("v2s", "v3", "v4", "v5", "v7")]:
                tq_case([[8192] * (m // 8192) + [m % 8192] for m in (n, n - 1000, n - 5037, 77)], 32, 8, 128, 4,
                        mx.bfloat16, variant=variant, steps=2)
            decode_attention.set_tq_unroll(4)
            decode_attention.set_tq3_load(decode_attention.DEFAULT_TQ3_LOAD)
    failed = [r for r in results if not r["ok"]]
    summary = {"checks": len(results), "failed": len(failed), "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

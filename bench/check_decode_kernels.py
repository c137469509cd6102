"""GPU check of engine/kernels/ against the reference paths; exits 1 on a mismatch.

    python bench/check_decode_kernels.py [--long] [--skip-dense] [--json out.json]
    python bench/check_decode_kernels.py --only-dense --long       # the dense kernels alone

What it checks, by default the production kernels and each fall-back of the TurboQuant dispatch
(engine/kernels/tq_decode.py: fused -> MMA split -> CUDA-core split -> generic):

* dense: `dense.attend` over left-padded `RowBatchKVCache` rows (strided views of the cache's
  buffer, as the model hands them) against MLX's masked SDPA on the same K/V in float32;
  float32 / bf16 / fp16, GQA 1-8, head dims 64 / 128 / 256 (and 16, the fixture's); each case
  records which kernel ran (`route`: dense_mma for bf16 / f16 at 64 / 128 / 256, else dense_split)
  and fails if it is not the one the dispatch should pick.
* TurboQuant: `cache.attend` through the kernels against SDPA over the decoded cache (what
  `update_and_fetch` returns), one row and left-padded batches, 2 / 4 / 8 bits, consecutive steps
  (the dense window shifts, deferred codes land); each case records the kernel that ran (`route`)
  and fails if it is not the dispatch's pick for the shape. Then the same production shapes with the
  faster kernels declined (`declined`), so each fall-back (tq_mma, tq_split, tq_generic) runs on
  the shapes the production kernel takes too.
* greedy tokens on fixtures/tiny-llama (float32) and on `wide_model` (head dim 128, bf16: the fused
  and the MMA dense kernel take its steps): TurboQuant with the kernels against the MLX-ops path
  (the `DecodeKernels` table: PREFIXTRACE_DECODE_ATTENTION=0) over a long generation, one row and a
  left-padded batch of three (whose dense last layer takes the dense kernel), and a dense padded batch.

Tolerances: float32 1e-4 absolute (the CPU tests' tolerance for the same comparison);
bf16 / fp16 outputs are rounded to their dtype, so 2e-2 / 4e-3 of the output's scale.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_lm.models.cache import KVCache  # noqa: E402

from engine.batch_cache import RowBatchKVCache  # noqa: E402
from engine.kernels import common, dense, selector, tq_decode, tq_fused, tq_mma, tq_split  # noqa: E402
from engine.tq_cache import BatchTurboQuantKVCache, TurboQuantKVCache  # noqa: E402

TOL = {mx.float32: 1e-4, mx.bfloat16: 2e-2, mx.float16: 4e-3}
ROUTES = ("tq_fused", "tq_mma", "tq_split", "tq_generic")
results: list[dict] = []


def record(kind: str, ok: bool, **info) -> None:
    results.append({"check": kind, "ok": bool(ok), **info})
    print(json.dumps(results[-1]), flush=True)


def err(got: mx.array, ref: mx.array) -> tuple[float, float]:
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    return mx.abs(got - ref).max().item(), mx.abs(ref).max().item()


def within(e: float, scale: float, dtype) -> bool:
    return e <= TOL[dtype] * (1.0 if dtype == mx.float32 else max(scale, 1.0))


def ran(before: dict) -> dict:
    """Kernel launches since `before` (a copy of `common.launches`)."""
    return {k: v - before.get(k, 0) for k, v in common.launches.items() if v - before.get(k, 0)}


@contextmanager
def declined(*routes: str):
    """The TurboQuant dispatch with the kernels `routes` (of `ROUTES`' first three) declining every step,
    so the next one down takes it: each fall-back checked on the shapes the production kernel takes."""
    saved = tq_decode.attend7, tq_decode.attend5, tq_decode.attend_split
    if "tq_fused" in routes:
        tq_decode.attend7 = lambda *a: None
    if "tq_mma" in routes:
        tq_decode.attend5 = lambda *a: None
    if "tq_split" in routes:
        tq_decode.attend_split = lambda *a: None
    try:
        yield
    finally:
        tq_decode.attend7, tq_decode.attend5, tq_decode.attend_split = saved


def tq_route(q, bits: int, g: int, dim: int, group: int, skip: tuple = ()) -> str:
    """The kernel the dispatch should pick for this step, the `skip`ped ones declining."""
    if "tq_fused" not in skip and tq_fused.usable7(q, bits, g, dim, group):
        return "tq_fused"
    if "tq_mma" not in skip and tq_mma.usable(q, bits, g, dim, tq_mma.chunk_capacity(g)):
        return "tq_mma"
    if "tq_split" not in skip and tq_split.cpl(g, dim, bits) is not None:
        return "tq_split"
    return "tq_generic"


def dense_case(lengths: list[int], q_heads: int, kv_heads: int, dim: int, dtype) -> None:
    mx.random.seed(sum(lengths) + dim)
    rows = []
    for n in lengths:
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, kv_heads, n, dim)).astype(dtype),
                           mx.random.normal((1, kv_heads, n, dim)).astype(dtype))
        rows.append(c)
    batch = RowBatchKVCache.merge(rows)
    B = len(lengths)
    mask = batch.make_mask(1)
    keys, values = batch.update_and_fetch(mx.random.normal((B, kv_heads, 1, dim)).astype(dtype),
                                          mx.random.normal((B, kv_heads, 1, dim)).astype(dtype))
    q = mx.random.normal((B, q_heads, 1, dim)).astype(dtype)
    scale = dim ** -0.5
    before = dict(common.launches)
    got = selector.CudaKernels(dense="all").dense_attend(batch, q, keys, values, scale, mask)
    ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys.astype(mx.float32),
                                               values.astype(mx.float32), scale=scale, mask=mask)
    e, s = err(got, ref)
    want = "dense_mma" if dense.usable_mma(q.dtype, keys.dtype, dim, q_heads // kv_heads) else "dense_split"
    launched = ran(before)
    record("dense", within(e, s, dtype) and launched == {want: 1}, rows=B, lengths=lengths[:4],
           heads=[q_heads, kv_heads], dim=dim, dtype=str(dtype), max_err=e, scale=s, route=want, ran=launched)


def tq_case(chunks_per_row: list[list[int]], q_heads: int, kv_heads: int, dim: int, bits: int, dtype,
            group: int = 64, steps: int = 3, skip: tuple = ()) -> None:
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
    with declined(*skip):
        for step in range(steps):
            keys, values = cache.update_and_fetch(mx.random.normal((B, kv_heads, 1, dim)).astype(dtype),
                                                  mx.random.normal((B, kv_heads, 1, dim)).astype(dtype))
            q = mx.random.normal((B, q_heads, 1, dim)).astype(dtype)
            scale = dim ** -0.5
            before = dict(common.launches)
            got = cache.attend(q, scale, mask)
            ref = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys.astype(mx.float32),
                                                       values.astype(mx.float32), scale=scale, mask=mask)
            e, s = err(got, ref)
            want = tq_route(q, bits, q_heads // kv_heads, dim, group, skip)
            launched = {k: v for k, v in ran(before).items() if k in ROUTES}
            record("turboquant", within(e, s, dtype) and launched == {want: 1}, declined=list(skip), rows=B,
                   lengths=[sum(c) for c in chunks_per_row][:4], heads=[q_heads, kv_heads], dim=dim, bits=bits,
                   dtype=str(dtype), step=step, max_err=e, scale=s, route=want, ran=launched)
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
    at a head shape the fused TurboQuant kernel and the MMA dense kernel take: head dim 128, 8 query /
    2 KV heads (G = 4), 3 layers (two TurboQuant, the last dense). fixtures/tiny-llama (head dim 16,
    float32) goes to the CUDA-core split kernel instead."""
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


def wide_model(dtype: str):
    """The fixture's recipe (random Llama weights at gain 3: chaotic enough that greedy tokens vary)
    at a head shape the tensor-core kernels map: head dim 128, 8 query / 2 KV heads (G = 4), 3 layers (two TurboQuant,
    the last dense). fixtures/tiny-llama's head dim 16 takes the CUDA-core kernels."""
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


def greedy_identity(steps: int, dense_too: bool = True, dtype: str = "float32", model_name: str = "tiny") -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from engine.attention_hook import install_attention_hook
    from engine.model_files import load_model_dir
    from engine.tq_config import make_tq_cache

    if model_name == "wide":
        model = wide_model(dtype)
    else:
        model, _, _ = load_model_dir(ROOT / "fixtures" / "tiny-llama", dtype)
    install_attention_hook(model)
    single = [[(i * 37 + 11) % 500 + 3 for i in range(300)]]
    batch = [[(i * 13 + 5) % 500 + 3 for i in range(n)] for n in (190, 17, 75)]
    cases = [("tq_single", lambda: make_tq_cache(model, bits=4), single),
             ("tq_padded_batch", lambda: make_tq_cache(model, bits=4), batch)]
    if dense_too:
        cases.append(("dense_padded_batch", lambda: make_prompt_cache(model), batch))
    cuda = selector.select()
    for name, make, prompts in cases:
        selector.select = lambda: selector.DecodeKernels(cuda=True)  # the MLX-ops path (DECODE_ATTENTION=0)
        try:
            ref = _greedy(model, make, prompts, steps)
        finally:
            selector.select = lambda: cuda
        before = dict(common.launches)
        got = _greedy(model, make, prompts, steps)
        same = [a == b for a, b in zip(got, ref)]
        first = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(got, ref)]
        # float32: identical tokens required. bf16: recorded, not required: there even the f32 arithmetic of
        # the CUDA-core kernels leaves the MLX-ops path (bf16 decoded K/V) within a few tokens on this chaotic
        # random model, so identity measures rounding there.
        record("greedy_" + name, all(same) or dtype != "float32", identical=all(same), steps=steps,
               rows=len(prompts), first_difference=first, dtype=dtype, model=model_name, ran=ran(before))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--long", action="store_true", help="also 32k / 100k contexts")
    ap.add_argument("--steps", type=int, default=400, help="greedy tokens compared on the fixture")
    ap.add_argument("--skip-dense", action="store_true", help="leave out the dense kernels' cases")
    ap.add_argument("--only-dense", action="store_true", help="the dense cases alone (with --long: the long rows too)")
    ap.add_argument("--skip-fallbacks", action="store_true",
                    help="leave out the production shapes rerun with the faster TurboQuant kernels declined")
    ap.add_argument("--skip-greedy", action="store_true", help="leave out the greedy-token identity")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not common.available():
        print("no CUDA device: nothing to check (the kernels are CUDA only)")
        return 0
    t0 = time.perf_counter()
    if not args.skip_dense:
        for dtype in (mx.float32, mx.bfloat16):
            dense_case([100], 32, 8, 128, dtype)
            dense_case([1000, 963, 100, 1], 32, 8, 128, dtype)
            dense_case([4097, 4000, 2500, 17, 4097, 64, 65, 3000], 32, 8, 128, dtype)
            dense_case([300, 250, 10], 9, 3, 64, dtype)  # SmolLM2: G = 3
            dense_case([70, 5], 4, 2, 16, dtype)  # the fixture
        dense_case([500, 20], 8, 8, 128, mx.float16)  # no GQA
        dense_case([800, 300], 64, 8, 128, mx.bfloat16)  # G = 8
        dense_case([4097, 4000, 2500, 17, 4097, 64, 65, 3000], 32, 8, 128, mx.float16)
        dense_case([600, 31, 1], 16, 4, 256, mx.bfloat16)
        dense_case([513, 2], 8, 8, 128, mx.float16)
    if not args.only_dense:
        for dtype in (mx.float32, mx.bfloat16, mx.float16):  # the production dispatch
            tq_case([[200, 9]], 32, 8, 128, 4, dtype)
            tq_case([[4000, 33]], 32, 8, 128, 4, dtype, steps=70)  # across group boundaries
            tq_case([[300], [7, 30, 1], [64], [1000, 3]], 32, 8, 128, 4, dtype, steps=20)
            tq_case([[150, 10], [70]], 9, 3, 64, 4, dtype, steps=20)  # G = 3
            tq_case([[100, 7], [20]], 4, 2, 16, 4, dtype, group=16, steps=20)  # the fixture's head dim
            tq_case([[300], [7, 30, 1], [64], [1000, 3]], 16, 4, 256, 4, dtype)  # D = 256
            tq_case([[64 * 7, 1]] * 8, 64, 8, 128, 4, dtype, steps=20)  # B = 8, G = 8
            tq_case([[500, 3], [64]], 8, 8, 128, 4, dtype, steps=20)  # G = 1
        for bits in (1, 2, 8):
            tq_case([[300], [7, 30, 1]], 32, 8, 128, bits, mx.float32, group=16, steps=20)
            tq_case([[300], [7, 30, 1]], 32, 8, 128, bits, mx.bfloat16, group=16, steps=20)
        tq_case([[100, 7], [20]], 4, 2, 16, 1, mx.float32, group=16, steps=20)  # D x bits < 32: generic
        if not args.skip_fallbacks:
            for skip in (("tq_fused",), ("tq_fused", "tq_mma"), ("tq_fused", "tq_mma", "tq_split")):
                for dtype in (mx.bfloat16, mx.float16):
                    tq_case([[4000, 33]], 32, 8, 128, 4, dtype, steps=70, skip=skip)
                    tq_case([[300], [7, 30, 1], [64], [1000, 3]], 32, 8, 128, 4, dtype, steps=20, skip=skip)
                    tq_case([[150, 10], [70]], 9, 3, 64, 4, dtype, steps=20, skip=skip)
                    tq_case([[64 * 7, 1]] * 8, 64, 8, 128, 4, dtype, steps=20, skip=skip)
    if not args.skip_greedy:
        greedy_identity(args.steps, dense_too=not args.skip_dense, dtype="float32")
        # the wide model (head dim 128) in bf16: the fused kernel and the MMA dense kernel take its steps
        greedy_identity(args.steps, dense_too=not args.skip_dense, dtype="bfloat16", model_name="wide")
    if args.long:
        for n in (32768, 100000):
            if not args.skip_dense:
                dense_case([n, n - 5000, 77], 32, 8, 128, mx.bfloat16)
                dense_case([n - 37 * i for i in range(8)], 32, 8, 128, mx.bfloat16)  # B = 8 left-padded rows
            if not args.only_dense:
                one = [[8192] * (n // 8192) + [n % 8192]]
                four = [[8192] * (m // 8192) + [m % 8192] for m in (n, n - 1000, n - 5037, 77)]
                for skip in ((), ("tq_fused",)) if not args.skip_fallbacks else ((),):
                    tq_case(one, 32, 8, 128, 4, mx.bfloat16, skip=skip)
                    tq_case(four, 32, 8, 128, 4, mx.bfloat16, steps=2, skip=skip)
    failed = [r for r in results if not r["ok"]]
    summary = {"checks": len(results), "failed": len(failed), "seconds": round(time.perf_counter() - t0, 1),
               "ran": dict(common.launches)}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

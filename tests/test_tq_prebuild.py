"""engine/kernels/prebuild.py: which TurboQuant decode kernels a CUDA engine builds at load, and
that the CPU builds none. The builds themselves run on the H200 (bench_turboquant.py
--engine-decode; docs/PERFORMANCE.md, "no kernel build inside a request")."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from engine.kernels import common, dense, prebuild, selector, tq_decode, tq_encode, tq_fused, tq_mma, tq_split  # noqa: F401
from engine.tq_config import TQConfig
from engine.turboquant import get_codec

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kv_heads, g, context, max_batch", [
    (8, 4, 40960, 8),   # Qwen3-8B, its context
    (3, 3, 8192, 8),    # SmolLM2-135M
    (8, 8, 131072, 2),  # G = 8 (smaller chunks fit shared memory), a long context
    (1, 2, 2048, 1),    # fewer columns than any change point but the first
])
def test_the_plan_holds_every_chunk_a_decode_step_can_pick(kv_heads, g, context, max_batch):
    """Every (rows, tokens) a decode step can have is served by a built chunk, and each planned
    launch really picks the chunk it is meant to build (a chunk missed is a compile inside a
    request; a launch that picks another chunk builds the wrong kernel)."""
    plan = prebuild.chunk_plan(kv_heads, g, context, max_batch)
    seen = {common.split_chunk(t, kv_heads, rows, g, at_least=1)
            for rows in range(1, max_batch + 1) for t in range(1, context + 1)} - {None}
    assert set(plan) == seen
    for chunk, (rows, tokens) in plan.items():
        assert rows <= max_batch and tokens <= context
        assert common.split_chunk(tokens, kv_heads, rows, g, at_least=1) == chunk


def test_qwen3_8b_at_one_row_needs_a_new_chunk_at_each_doubling_past_8k():
    # The first-engine one-off the builds at load removed: a 4k warm-up built chunk 64 only; 32,768 tokens pick 256 and
    # the step queued after the first token (32,769) picks 512.
    pick = lambda t: common.split_chunk(t, 8, 1, 4, at_least=1)  # noqa: E731
    assert [pick(t) for t in (4096, 4097, 8193, 32768, 32769, 100000)] == [64, 64, 128, 256, 512, 1024]
    assert prebuild.chunk_plan(8, 4, 40960, 1) == {64: (1, 1), 128: (1, 8193), 256: (1, 16385),
                                                     512: (1, 32769)}
    # What an engine builds: past the model's stated context too (a 100k prompt on a 40,960-token
    # model is not refused below the memory ceiling).
    assert set(prebuild.chunk_plan(8, 4, prebuild.PLAN_TOKENS, 1)) == {64, 128, 256, 512, 1024}


def test_the_cpu_builds_nothing():
    """No CUDA: no kernel is launched (a launch would raise here) and nothing is reported."""
    from mlx_lm.utils import load

    model, _ = load(str(ROOT / "fixtures" / "tiny-llama"))
    assert not common.available()
    assert selector.select().prebuild_tq(model, TQConfig(), max_batch=8) == {}
    assert prebuild.model_shape(model) == (model.args.num_attention_heads, model.args.num_key_value_heads,
                                              model.args.hidden_size // model.args.num_attention_heads)


@pytest.mark.parametrize("kv_quant", ["turboquant", "none"])
def test_an_engine_builds_at_load_only_with_turboquant(monkeypatch, kv_quant):
    """The engine asks for the builds while it loads, with its own batch size, only when its
    caches are TurboQuant; on the CPU the answer is that nothing was built."""
    from engine.engine import Engine

    calls = []
    real = selector.DecodeKernels.prebuild_tq

    def recorded(self, model, tq, max_batch):
        calls.append((tq, max_batch))
        return real(self, model, tq, max_batch)

    monkeypatch.setattr(selector.DecodeKernels, "prebuild_tq", recorded)
    engine = Engine(model_dir=str(ROOT / "fixtures" / "tiny-llama"), kv_quant=kv_quant, max_batch=3,
                    cache_bytes=0).start()
    try:
        assert engine.wait_ready(120)
        assert engine.tq_kernel_build_s == {}
        assert calls == ([(engine.tq, 3)] if kv_quant == "turboquant" else [])
    finally:
        engine.shutdown()


def _module_name(name: str, template: list) -> str:
    """The name MLX gives a custom kernel's module (mlx/backend/cuda/custom_kernel.cpp:
    "custom_kernel_" + name + template_arguments_hash): the in-process and on-disk key."""
    parts = []
    for _, v in template:
        parts.append(("t" if v else "f") if isinstance(v, bool) else str(v))
    return "custom_kernel_" + name + "".join("_" + p for p in parts)


def test_the_fused_encode_is_named_per_dtype(monkeypatch):
    """MLX writes the inputs' dtypes into a custom kernel's source but names the module by
    its template arguments only, so two dtypes under one template ran one build: the encode's
    template carries the dtype. The kernel cannot run here; what `encode_kv` asks MLX for is
    recorded instead."""
    asked = []

    def kernel(**kw):
        asked.append(kw["template"])
        nv = kw["output_shapes"][0][0]
        words = kw["output_shapes"][1][1]
        return [mx.zeros((nv,)), mx.zeros((nv, words), mx.uint32), mx.zeros((nv,)), mx.zeros((nv, words), mx.uint32)]

    monkeypatch.setattr(tq_encode, "_encode_kernel", lambda: kernel)
    codec = get_codec(64, 4)
    for dtype in (mx.float32, mx.bfloat16):
        x = mx.zeros((1, 2, 3, 64), dtype)
        tq_encode.encode(x, x, codec)
    names = {_module_name("prefixtrace_tq_encode", t) for t in asked}
    assert len(asked) == 2 and len(names) == 2, names


def test_the_launches_fit_the_kernels_signatures(monkeypatch):
    """What the builds would launch on CUDA, made on the CPU: one attention call per planned
    chunk, shaped as a decode step of that many rows and columns, bound against `tq_decode.attend`'s
    and `tq_encode.encode`'s signatures (a change there would otherwise surface only on the device)."""
    import inspect

    from mlx_lm.utils import load

    model, _ = load(str(ROOT / "fixtures" / "tiny-llama"))
    hq, heads, dim = prebuild.model_shape(model)
    monkeypatch.setattr(tq_decode, "usable", lambda q, kv_heads, bits, d: (q.shape[1], kv_heads, d) == (hq, heads, dim))
    plan = prebuild.tq_launches(model, TQConfig(), max_batch=4)
    assert plan is not None and plan[0][0] == 0
    inspect.signature(tq_encode.encode).bind(*plan[0][1])
    assert [c for c, _ in plan[1:]] == list(prebuild.chunk_plan(heads, hq // heads, prebuild.PLAN_TOKENS, 4))
    for chunk, args in plan[1:]:
        bound = inspect.signature(tq_decode.attend).bind(*args).arguments
        rows, tokens = bound["k_codes"].shape[0], bound["k_codes"].shape[2]
        assert bound["queries"].shape == (rows, hq, 1, dim) and bound["win_k"].shape[:2] == (rows, heads)
        assert common.split_chunk(tokens, heads, rows, hq // heads, at_least=bound["win_k"].shape[2]) == chunk

"""Left-padded batched decode (issue 17): what a padded step does beyond an equal one, on the CPU.

The finding bench/bench_decode_mask.py's split rests on (docs/PERFORMANCE.md, "Padded batched
decode (issue 17, session 7)"): outside attention a padded step builds the same graph as an equal
step (RoPE takes the cache's per-row offset array in both; the cache update is the same), and the
padding mask is the only extra, built once per step and read only by a masked attention. And the
dense kernel's launch shape (`decode_attention.dense_shape`) changes how a step is split, never
its tokens (the kernels' arithmetic emulated in numpy, tests/test_decode_attention.py)."""

from __future__ import annotations

import collections
import re

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from bench.bench_decode_mask import _copy_attention, attention_replaced, batch_cache
from engine.kernels import common, dense, prebuild, selector, tq_decode, tq_encode, tq_fused, tq_mma, tq_split  # noqa: F401
from engine.batch_cache import RowBatchKVCache
from engine.attention_hook import install_attention_hook
from tests.test_decode_attention import emulated  # noqa: F401  (fixture)


@pytest.fixture(scope="module")
def small_qwen3():
    from mlx_lm.models import qwen3

    shape = dict(model_type="qwen3", hidden_size=128, num_hidden_layers=3, intermediate_size=256,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, vocab_size=300,
                 max_position_embeddings=2048, rope_theta=1e6, tie_word_embeddings=False)
    mx.random.seed(1)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(shape))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    install_attention_hook(model)
    return model


def primitives(tmp_path, name: str, *arrays) -> collections.Counter:
    """The primitives of the graph that evaluating `arrays` runs, by name (mx.export_to_dot)."""
    path = tmp_path / f"{name}.dot"
    mx.export_to_dot(str(path), *arrays)
    return collections.Counter(re.findall(r'label ="([A-Za-z]+)', path.read_text()))


def step_graph(tmp_path, model, cache, name: str) -> collections.Counter:
    tokens = mx.zeros((len(cache[0].left_padding), 1), dtype=mx.int32)
    logits = model(tokens, cache=cache)
    counts = primitives(tmp_path, name, logits, *[a for c in cache for a in (c.keys, c.values)])
    mx.eval(logits)
    for c in cache:
        c.trim(1)
    return counts


def test_outside_attention_a_padded_step_builds_the_equal_steps_graph(tmp_path, small_qwen3):
    equal = batch_cache(small_qwen3, [96] * 4)
    padded = batch_cache(small_qwen3, [96, 90, 71, 40])
    with attention_replaced(small_qwen3, _copy_attention):
        outside_equal = step_graph(tmp_path, small_qwen3, equal, "equal_copy")
        outside_padded = step_graph(tmp_path, small_qwen3, padded, "padded_copy")
    assert outside_padded == outside_equal
    assert outside_equal["SliceUpdate"] == 2 * 3  # K and V per layer: the cache update is in the graph
    # With attention, the padded step adds the mask (built once, read by each masked SDPA) and nothing else.
    extra = step_graph(tmp_path, small_qwen3, padded, "padded") - step_graph(tmp_path, small_qwen3, equal, "equal")
    assert extra["GreaterEqual"] == 1 and extra["BitwiseAnd"] == 1 and extra["Arange"] >= 1
    assert not (set(extra) & {"SliceUpdate", "Matmul", "RoPE", "Sin", "Cos", "Concatenate", "Gather"})


def test_rope_sees_one_offset_array_whether_or_not_rows_are_padded(small_qwen3):
    """mlx-lm's BatchKVCache gives RoPE its per-row `offset` array in both cases: an equal
    batch pays the same RoPE as a padded one, so RoPE is not what padding costs."""
    equal = batch_cache(small_qwen3, [50] * 3)
    padded = batch_cache(small_qwen3, [50, 45, 30])
    assert equal[0].offset.shape == padded[0].offset.shape == (3,)
    assert equal[0].offset.tolist() == [50] * 3 and padded[0].offset.tolist() == [50, 45, 30]


def test_dense_shape_setting_and_its_env_vars(monkeypatch):
    saved = decode_attention.dense_shape()
    try:
        with pytest.raises(ValueError):
            decode_attention.set_dense_shape(3000, 4)
        with pytest.raises(ValueError):
            decode_attention.set_dense_shape(1024, 5)
        monkeypatch.setattr(decode_attention, "_dense_shape", None)
        monkeypatch.setenv("PREFIXTRACE_DENSE_BLOCKS", "4096")
        monkeypatch.setenv("PREFIXTRACE_DENSE_UNROLL", "8")
        assert decode_attention.dense_shape() == (4096, 8)
        monkeypatch.setattr(decode_attention, "_dense_shape", None)
        monkeypatch.setenv("PREFIXTRACE_DENSE_BLOCKS", "12")  # not a shape: the default
        monkeypatch.delenv("PREFIXTRACE_DENSE_UNROLL")
        assert decode_attention.dense_shape() == (1024, 4)
    finally:
        decode_attention.set_dense_shape(*saved)
    # 8 rows x 4k x 8 KV heads: chunk 256 at 1,024 target blocks, 64 at 4,096 (4,096 blocks).
    assert common.split_chunk(4096, 8, 8, 4) == 256
    assert common.split_chunk(4096, 8, 8, 4, target=2048) == 128
    assert common.split_chunk(4096, 8, 8, 4, target=4096) == 64


def _launches(monkeypatch) -> list:
    seen = []
    wrapped = decode_attention._dense_kernel()

    def recording(**kw):
        seen.append((dict(kw["template"]), kw["grid"]))
        return wrapped(**kw)

    monkeypatch.setattr(decode_attention, "_dense_kernel", lambda: recording)
    return seen


def test_greedy_tokens_of_a_left_padded_batch_equal_at_every_dense_shape(emulated, monkeypatch):  # noqa: F811
    """Three left-padded rows on the fixture, 24 greedy tokens: MLX's masked SDPA and the
    (emulated) start-offset kernel at every launch shape give the same tokens; each shape
    launches the split it says."""
    from engine.model_files import load_model_dir
    from tests.conftest import TINY_MODEL

    model, _, _ = load_model_dir(TINY_MODEL, "float32")
    install_attention_hook(model)
    prompts = [[(i * 37 + 11 * r) % 500 + 3 for i in range(n)] for r, n in enumerate((70, 41, 9))]
    seen = _launches(monkeypatch)

    def greedy(mode: str) -> list[list[int]]:
        decode_attention.set_mode(mode)
        rows = []
        for p in prompts:
            cache = [KVCache() for _ in model.layers]
            model(mx.array([p[:-1]]), cache=cache)
            rows.append(cache)
        cache = [RowBatchKVCache.merge([r[i] for r in rows]) for i in range(len(model.layers))]
        token = mx.array([[p[-1]] for p in prompts])
        out = []
        for _ in range(24):
            token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
            out.append(token[:, 0].tolist())
        return out

    saved = decode_attention.dense_shape()
    try:
        reference = greedy("off")
        assert not seen  # the masked path launches nothing
        for blocks, unroll in ((1024, 4), (4096, 8)):
            decode_attention.set_dense_shape(blocks, unroll)
            seen.clear()
            assert greedy("on") == reference
            assert seen and all(t["U"] == unroll for t, _ in seen)
            # at these lengths the smallest chunk (64) serves both targets: the grid says how many splits
            t, grid = seen[-1]
            assert grid[0] // (t["NW"] * 32) == -(-93 // t["CHUNK"])  # 70 + 24 - 1 columns at the last step
    finally:
        decode_attention.set_dense_shape(*saved)
        decode_attention.set_mode("on")


def test_the_bench_runs_its_gpu_branches_through_the_emulated_kernel(emulated, monkeypatch, tmp_path):  # noqa: F811
    """bench/bench_decode_mask.py end to end on the fixture with the kernels emulated, so a typo in
    its CUDA-only branches (kernel shapes, logits check, attention alone, GenerationBatch) costs
    no device time; every figure the docs read is in its JSON."""
    import json
    import sys

    from bench import bench_decode_mask

    out = tmp_path / "mask.json"
    monkeypatch.setattr(sys, "argv", ["bench_decode_mask.py", "--attention", "both", "--attention-only",
                                      "--context", "80", "--repeats", "2", "--dense-shape", "1024x4",
                                      "--dense-shape", "4096x8", "--generation-batch", "3", "--json", str(out),
                                      "--dense-variants", "v1,mma"])
    saved = decode_attention.dense_shape()
    mx.random.seed(0)  # the bench's K/V: unseeded, 1 of 8 greedy rows sometimes flipped on a bf16 near-tie
    try:
        bench_decode_mask.main()
    finally:
        decode_attention.set_dense_shape(*saved)
        decode_attention.set_mode("on")
    result = json.loads(out.read_text())
    row = result["runs"][0]
    for key in ("equal_ms", "equal_build_ms", "equal_pipelined_ms", "padded_masked_vs_equal", "padded_kernel_ms",
                "padded_kernel_4096x8_ms", "padded_kernel_pipelined_vs_equal", "equal_kernel_vs_equal",
                "padded_copy_vs_equal_copy", "padded_copy_pipelined_vs_equal_copy", "attn_equal_sdpa_us",
                "attn_padded_masked_us", "attn_padded_kernel_us", "attn_padded_kernel_4096x8_us",
                "attn_equal_kernel_us", "padded_kernel_mma_ms", "padded_kernel_mma_4096x8_ms",
                "padded_kernel_mma_pipelined_vs_equal", "equal_kernel_mma_vs_equal", "attn_padded_kernel_mma_us",
                "attn_padded_kernel_mma_vs_sdpa", "attn_equal_kernel_mma_us", "attn_equal_sdpa_again_us"):
        assert row[key] > 0, key
    assert row["padded_kernel_mma_check"]["argmax_agree"] == 1.0  # (head dim 16: the MMA variant runs v1)
    assert decode_attention.dense_variant() == "v1"  # the bench restores the variant it found (the fixture's)
    # each variant's chunk instances built before any timing, as an engine builds them at load
    assert set(result["prebuild_s"]) == {"default", "_mma"} and "64" in result["prebuild_s"]["_mma"]
    assert not [k for k in row if k.startswith("warmup")]
    # the emulated kernel computes what masked SDPA does: same greedy choice for every row
    assert row["padded_kernel_check"]["argmax_agree"] == 1.0 and row["padded_kernel_check"]["max_rel_err"] < 0.05
    assert {"equal_tok_s", "padded_masked_tok_s", "padded_kernel_tok_s"} <= set(result["generation_batch"])


def _offset_attention(queries, keys, values, left_padding, scale):
    """Attention of one query per row over columns [left_padding[b], T), in MLX ops that
    share none of the padding mask's comparisons (a graph-preserving stand-in for the kernel)."""
    B, hq, _, D = queries.shape
    H, T = keys.shape[1], keys.shape[2]
    q = queries.reshape(B, H, hq // H, D)
    scores = (q * scale) @ keys.swapaxes(-1, -2)  # (B, H, G, T)
    bias = mx.minimum(mx.arange(T)[None, :] - left_padding[:, None], 0).astype(scores.dtype) * 1e9
    out = mx.softmax(scores + bias[:, None, None, :], axis=-1) @ values
    return out.reshape(B, hq, 1, D)


def test_the_padding_mask_is_not_evaluated_when_the_kernel_takes_the_step(tmp_path, small_qwen3, monkeypatch):
    """mlx-lm still builds the mask each step, but the kernel route reads `left_padding`, not the
    mask: none of the mask's nodes reach the graph that evaluating the step runs."""
    mask_nodes = {"GreaterEqual", "LessEqual", "BitwiseAnd"}
    padded = batch_cache(small_qwen3, [96, 90, 71, 40])
    decode_attention.set_mode("off")
    try:
        masked = step_graph(tmp_path, small_qwen3, padded, "masked")
    finally:
        decode_attention.set_mode("on")
    assert mask_nodes <= set(masked)  # the control: MLX's masked SDPA reads it
    monkeypatch.setattr(decode_attention, "available", lambda: True)
    calls = []
    monkeypatch.setattr(decode_attention, "dense_attend", lambda *a: calls.append(1) or _offset_attention(*a))
    kernel_route = step_graph(tmp_path, small_qwen3, padded, "kernel_route")
    assert len(calls) == 3  # every layer took the route
    assert not mask_nodes & set(kernel_route)

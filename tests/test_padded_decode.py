"""Left-padded batched decode (issue 17): what a padded step does beyond an equal one, on the CPU.

The finding the padded dense decode kernel rests on (docs/history/PERFORMANCE-notebook.md, "Padded
batched decode"): outside attention a padded step builds the same graph as an equal
step (RoPE takes the cache's per-row offset array in both; the cache update is the same), and the
padding mask is the only extra, built once per step and read only by a masked attention. And the
dense kernel gives a padded batch the tokens masked SDPA gives (its arithmetic emulated in numpy,
tests/test_decode_attention.py)."""

from __future__ import annotations

import collections
import re
import sys
from contextlib import contextmanager

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from engine.attention_hook import install_attention_hook
from engine.batch_cache import RowBatchKVCache
from engine.kernels import dense, selector
from tests.test_decode_attention import emulated, use_kernels  # noqa: F401  (fixture)


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
    """Per layer, a `RowBatchKVCache` of rows of `lengths` random bf16 tokens (left-padded to the longest)."""
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


def _launches(monkeypatch) -> list:
    seen = []
    wrapped = dense._kernel()

    def recording(**kw):
        seen.append((dict(kw["template"]), kw["grid"]))
        return wrapped(**kw)

    monkeypatch.setattr(dense, "_kernel", lambda: recording)
    return seen


def test_greedy_tokens_of_a_left_padded_batch_equal_through_the_kernel(emulated, monkeypatch):  # noqa: F811
    """Three left-padded rows on the fixture, 24 greedy tokens: MLX's masked SDPA and the
    (emulated) start-offset kernel give the same tokens; the kernel launches the split it says."""
    from engine.model_files import load_model_dir
    from tests.conftest import TINY_MODEL

    model, _, _ = load_model_dir(TINY_MODEL, "float32")
    install_attention_hook(model)
    prompts = [[(i * 37 + 11 * r) % 500 + 3 for i in range(n)] for r, n in enumerate((70, 41, 9))]
    seen = _launches(monkeypatch)

    cuda = selector.select()

    def greedy(kernels) -> list[list[int]]:
        use_kernels(monkeypatch, kernels)
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

    reference = greedy(selector.DecodeKernels())
    assert not seen  # the masked path launches nothing
    assert greedy(cuda) == reference
    assert seen and all(t["U"] == dense.UNROLL for t, _ in seen)
    # at these lengths the smallest chunk (64) serves: the grid says how many splits
    t, grid = seen[-1]
    assert grid[0] // (t["NW"] * 32) == -(-93 // t["CHUNK"])  # 70 + 24 - 1 columns at the last step


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
    masked = step_graph(tmp_path, small_qwen3, padded, "masked")  # the CPU: no kernels
    assert mask_nodes <= set(masked)  # the control: MLX's masked SDPA reads it
    use_kernels(monkeypatch, selector.CudaKernels())
    calls = []
    monkeypatch.setattr(dense, "attend", lambda *a: calls.append(1) or _offset_attention(*a))
    kernel_route = step_graph(tmp_path, small_qwen3, padded, "kernel_route")
    assert len(calls) == 3  # every layer took the route
    assert not mask_nodes & set(kernel_route)

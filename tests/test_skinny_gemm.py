"""The skinny GEMM hook (engine/skinny_gemm.py). The kernel itself needs CUDA and is
checked against MLX's matmul by bench/bench_skinny_gemm.py on the GPU; here: the swap
is complete, shares the weights, and changes nothing where the kernel cannot run."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine import skinny_gemm
from engine.model_files import load_model_dir
from tests.conftest import TINY_MODEL


def test_install_is_a_no_op_without_cuda():
    model, _, _ = load_model_dir(TINY_MODEL, "float32")
    assert skinny_gemm.install(model) == 0
    assert not any(isinstance(m, skinny_gemm.SkinnyLinear) for _, m in model.named_modules())


def small_qwen3():
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs.from_dict(dict(
        model_type="qwen3", hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, vocab_size=300, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=False))
    model = qwen3.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def test_install_swaps_every_eligible_linear_and_keeps_outputs(monkeypatch):
    model = small_qwen3()  # widths that are multiples of 256, as the kernel needs
    tokens = mx.array([[1, 5, 9, 200, 17]])
    before = model(tokens)
    eligible = [name for name, m in model.named_modules()
                if type(m) is nn.Linear and m.weight.shape[1] % 256 == 0]
    weights = {name: m.weight for name, m in model.named_modules() if name in eligible}
    monkeypatch.setattr(skinny_gemm, "available", lambda: True)
    assert skinny_gemm.install(model) == len(eligible) > 0
    monkeypatch.undo()  # on a CPU the swapped layers fall back to their own matmul
    swapped = dict(model.named_modules())
    for name in eligible:
        assert isinstance(swapped[name], skinny_gemm.SkinnyLinear)
        assert swapped[name].weight is weights[name]  # shared, not copied
    assert mx.array_equal(model(tokens), before)


def test_skinny_linear_keeps_a_bias():
    linear = nn.Linear(256, 64)
    skinny = skinny_gemm.SkinnyLinear.from_linear(linear)
    x = mx.random.normal((3, 256))
    assert mx.allclose(skinny(x), linear(x)).item()
    assert set(skinny.parameters()) == {"weight", "bias"}


def test_kernel_choice_follows_the_measured_table():
    import mlx.core as mx

    assert skinny_gemm.use_mma(4096, mx.bfloat16) and skinny_gemm.use_mma(12288, mx.bfloat16)
    assert not skinny_gemm.use_mma(1024, mx.bfloat16)  # K/V: too few 16-row tiles
    assert not skinny_gemm.use_mma(151936, mx.bfloat16)  # LM head: cuBLAS is flat in the rows
    assert not skinny_gemm.use_mma(4096, mx.float16)  # the mma instruction used is bf16
    assert skinny_gemm.use_kernel(2, 12288) and skinny_gemm.use_kernel(8, 1024)
    assert not skinny_gemm.use_kernel(8, 12288) and not skinny_gemm.use_kernel(1, 4096)

"""The skinny GEMM hook (engine/kernels/skinny_gemm.py). The kernel itself needs CUDA and is
checked against MLX's matmul by bench/bench_skinny_gemm.py on the GPU; here: the swap
is complete, shares the weights, and changes nothing where the kernel cannot run."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engine.kernels import skinny_gemm
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
    assert skinny_gemm.install(model, stack=False) == len(eligible) > 0  # each layer keeps its own array
    monkeypatch.undo()  # on a CPU the swapped layers fall back to their own matmul
    swapped = dict(model.named_modules())
    for name in eligible:
        assert isinstance(swapped[name], skinny_gemm.SkinnyLinear)
        assert swapped[name].weight is weights[name]  # shared, not copied
    assert mx.array_equal(model(tokens), before)


def test_stacked_projections_take_one_launch_and_give_the_same_logits(monkeypatch):
    """q/k/v and gate/up stacked (the default mma mode): a batched decode step launches one
    product per stack, the members hold views of the stacked weight, and the logits match
    the unstacked model. The CUDA kernel is replaced by MLX's matmul honouring `parts`."""
    launches = []

    def matmul_by_parts(x, w, warps=None, parts=None):
        launches.append((x.shape[0], w.shape[0], parts))
        y = x @ w.T
        if not parts:
            return y
        cuts = [sum(parts[:i]) for i in range(1, len(parts))]
        return [mx.contiguous(p) for p in mx.split(y, cuts, axis=-1)]

    model = small_qwen3()
    step = mx.array([[1], [5], [9]])  # three rows of one token: a batched decode step
    prompt = mx.array([[1, 5, 9, 200, 17]])
    before_step, before_prompt = model(step), model(prompt)
    q_weight = model.layers[0].self_attn.q_proj.weight
    monkeypatch.setattr(skinny_gemm, "available", lambda: True)
    monkeypatch.setattr(skinny_gemm, "skinny_matmul_mma", matmul_by_parts)
    monkeypatch.setattr(skinny_gemm, "skinny_matmul", lambda x, w: launches.append("cuda-core") or x @ w.T)
    skinny_gemm.install(model)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert attn.q_proj.stack is attn.k_proj.stack is attn.v_proj.stack is not None
    assert mlp.gate_proj.stack is mlp.up_proj.stack is not None and mlp.down_proj.stack is None
    assert mx.array_equal(attn.q_proj.weight, q_weight)
    after = model(step)
    # per layer: q|k|v, o, gate|up, down; the LM head (300 outputs, not a multiple of 16)
    # goes to the CUDA-core kernel
    assert len(launches) == 4 * len(model.layers) + 1 and launches[-1] == "cuda-core"
    assert sorted({parts for _, _, parts in launches[:-1] if parts}) == [(256, 128, 128), (512, 512)]
    assert mx.allclose(after, before_step, atol=1e-2, rtol=1e-2).item()
    assert (after.argmax(-1) == before_step.argmax(-1)).all().item()
    launches.clear()
    assert mx.allclose(model(prompt), before_prompt, atol=1e-2, rtol=1e-2).item()  # 5 rows: skinny path too
    assert len(launches) == 4 * len(model.layers) + 1


def test_a_member_called_on_another_input_computes_its_own_product(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "available", lambda: True)
    monkeypatch.setattr(skinny_gemm, "skinny_matmul_mma",
                        lambda x, w, warps=None, parts=None: [x @ p.T for p in mx.split(w, [64], axis=0)]
                        if parts else x @ w.T)
    gate = skinny_gemm.SkinnyLinear.from_linear(nn.Linear(256, 64, bias=False))
    up = skinny_gemm.SkinnyLinear.from_linear(nn.Linear(256, 64, bias=False))
    gate.set_dtype(mx.bfloat16), up.set_dtype(mx.bfloat16)
    holder = nn.Module()
    holder.gate_proj, holder.up_proj = gate, up
    assert skinny_gemm.stack_projections(holder) == 1
    a, b = mx.random.normal((4, 256)).astype(mx.bfloat16), mx.random.normal((4, 256)).astype(mx.bfloat16)
    gate(a)
    assert mx.array_equal(up(b), b @ up.weight.T)  # not the part computed for a
    assert mx.array_equal(up(a), a @ up.weight.T)


def test_skinny_linear_keeps_a_bias():
    linear = nn.Linear(256, 64)
    skinny = skinny_gemm.SkinnyLinear.from_linear(linear)
    x = mx.random.normal((3, 256))
    assert mx.allclose(skinny(x), linear(x)).item()
    assert set(skinny.parameters()) == {"weight", "bias"}


def test_kernel_choice_follows_the_measured_table():
    import mlx.core as mx

    assert skinny_gemm.use_mma(4096, mx.bfloat16) and skinny_gemm.use_mma(12288, mx.bfloat16)
    assert skinny_gemm.use_mma(1024, mx.bfloat16) and skinny_gemm.use_mma(6144, mx.bfloat16)
    assert not skinny_gemm.use_mma(151936, mx.bfloat16)  # LM head: cuBLAS is flat in the rows
    assert not skinny_gemm.use_mma(4096, mx.float16)  # the mma instruction used is bf16
    assert skinny_gemm.use_kernel(2, 12288) and skinny_gemm.use_kernel(8, 1024)
    assert not skinny_gemm.use_kernel(8, 12288) and not skinny_gemm.use_kernel(1, 4096)


def emulated_mma_kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
    """What `_MMA_SOURCE` computes, on the CPU: x @ w.T stored part by part (features [0, P1),
    [P1, P2), [P2, N)), each part R x width row-major, as one flat array."""
    x, w = inputs
    t = dict(template)
    assert grid[0] == t["N"] // 16 * 32 * t["WARPS"] and threadgroup[0] == 32 * t["WARPS"]
    y = x @ w.T
    cuts = [0, t["P1"], t["P2"], t["N"]]
    flat = mx.concatenate([y[:, a:b].reshape(-1) for a, b in zip(cuts, cuts[1:]) if b > a])
    assert flat.shape == output_shapes[0]
    return [flat.astype(output_dtypes[0])]


def test_mma_launch_unpacks_stacked_parts_as_the_kernel_stores_them(monkeypatch):
    monkeypatch.setattr(skinny_gemm, "_mma_kernel", lambda: emulated_mma_kernel)
    x = mx.random.normal((3, 256)).astype(mx.bfloat16)
    w = (mx.random.normal((384, 256)) * 0.1).astype(mx.bfloat16)
    whole = skinny_gemm.skinny_matmul_mma(x, w)
    assert whole.shape == (3, 384) and mx.array_equal(whole, x @ w.T)
    q, k, v = skinny_gemm.skinny_matmul_mma(x, w, parts=(256, 64, 64))
    assert [p.shape for p in (q, k, v)] == [(3, 256), (3, 64), (3, 64)]
    for part, rows in ((q, w[:256]), (k, w[256:320]), (v, w[320:])):
        assert mx.array_equal(part, x @ rows.T)
    gate, up = skinny_gemm.skinny_matmul_mma(x, w, parts=(192, 192))
    assert mx.array_equal(gate, x @ w[:192].T) and mx.array_equal(up, x @ w[192:].T)


def test_split_k_occupies_the_gpu_without_splitting_k_unevenly():
    assert skinny_gemm.mma_warps(1024, 4096) == 16  # 64 tiles: as many warps per tile as allowed
    assert skinny_gemm.mma_warps(4096, 4096) == 8  # 256 tiles x 8 = 2,048 warps
    assert skinny_gemm.mma_warps(24576, 4096) == 2
    assert skinny_gemm.mma_warps(151936, 4096) == 1
    assert skinny_gemm.mma_warps(4096, 192) == 2  # K = 192, six 32-wide slices: 2 warps take 3 each, 4 would not split evenly

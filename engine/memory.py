"""The memory model: one formula for admission, pausing, resuming, never-fits and capacity.

    need(request) = KV bytes per token x (prompt + max_tokens) + transient
    capacity      = ceiling - weights

`weights` is the model's parameter bytes; KV bytes per token come from the
model's shape (dense: K and V, every layer, in the activation dtype); the
transient peak is what one prefill chunk allocates on top of the KV (the
chunk's activations and its logits). Decisions use these estimates, not live
readings, so they are deterministic; `measured()` reports MLX's own counters
next to them and a test keeps the two within a stated tolerance.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import mlx.core as mx
from mlx.utils import tree_flatten

from prefixtrace.common.errors import ContextExceedsCapacity

DEFAULT_CEILING_FRACTION = 0.75  # of the machine's (or accelerator's) memory
SOFT_WATERMARK = 0.85  # of capacity: stop admitting new work
HARD_WATERMARK = 0.95  # of capacity: pause running work


# The memory tier's default share of what the ceiling leaves after the weights; requests
# (KV and prefill peaks) get the rest. Replaces a fixed 2 GB, less than the KV of one
# 32k-token prompt of an 8B model (4.8 GB): on the H200 with Qwen3-8B this is ~27 GB.
CACHE_FRACTION = 0.3
# Tokens per prefill chunk, measured per device (docs/PERFORMANCE.md, "Prefill chunk"):
# H200, 32k-token prompt, plain mlx-lm: 2.18 / 1.59 / 1.45 / 1.42 s at 512 / 2048 / 4096 /
# 8192; 4096 is within 3% of 8192 at half its transient memory and decode stall per chunk.
# CPU (2-vCPU VM, SmolLM2-135M as serve loads it, OpenBLAS, 1,024-token prompt,
# interleaved runs): 128 / 256 / 512 / 1024 at 9.6 / 10.5 / 11.0 / 14.2 s (medians; first runs at load
# 0.4: 9.0 / 8.2 / 8.7 / 12.0): 1024 and up is slower, below 512 is not measurably faster, and 512
# commits to the prefix cache in half the chunks of 256.
PREFILL_CHUNK_ACCELERATOR = 4096
PREFILL_CHUNK_CPU = 512


def default_prefill_chunk() -> int:
    return PREFILL_CHUNK_CPU if mx.default_device().type == mx.DeviceType.cpu else PREFILL_CHUNK_ACCELERATOR


def default_cache_bytes(weights_bytes: int) -> int:
    """The memory tier's budget: CACHE_FRACTION of the default ceiling left after the weights
    (the accelerator's memory on CUDA/Metal, RAM on the CPU)."""
    return max(0, int((machine_memory_bytes() * DEFAULT_CEILING_FRACTION - weights_bytes) * CACHE_FRACTION))


def weights_bytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def machine_memory_bytes() -> int:
    info = mx.device_info()
    if "memory_size" in info:  # Metal / CUDA report the accelerator's memory
        return int(info["memory_size"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class MemoryModel:
    weights_bytes: int
    kv_bytes_per_token: int
    transient_bytes: int
    ceiling_bytes: int
    context_length: int

    @classmethod
    def for_model(cls, model, *, context_length: int, prefill_chunk: int, ceiling_bytes: int | None = None):
        weights = weights_bytes(model)
        args = model.args
        heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        itemsize = _activation_itemsize(model)
        kv_per_token = 2 * args.num_hidden_layers * heads * head_dim * itemsize
        # One chunk's activations (residual, attention projections, MLP) and its
        # logits, which mlx-lm computes for every position of the chunk in float32.
        hidden = args.hidden_size * (4 + 2 * args.intermediate_size // args.hidden_size)
        transient = prefill_chunk * (hidden * itemsize + args.vocab_size * 4)
        ceiling = ceiling_bytes if ceiling_bytes is not None else int(machine_memory_bytes() * DEFAULT_CEILING_FRACTION)
        return cls(weights, kv_per_token, transient, ceiling, context_length)

    @property
    def capacity_bytes(self) -> int:
        """What the KV and the transient peak may use, beside the weights."""
        return max(0, self.ceiling_bytes - self.weights_bytes)

    @property
    def max_context_tokens(self) -> int:
        by_memory = (self.capacity_bytes - self.transient_bytes) // max(1, self.kv_bytes_per_token)
        return int(max(0, min(by_memory, self.context_length)))

    def need_bytes(self, num_tokens: int) -> int:
        """KV of a sequence at its final length, plus one prefill chunk's peak."""
        return self.kv_bytes_per_token * num_tokens + self.transient_bytes

    def fit(self, prompt_tokens: int, max_tokens: int | None, *, clamp: bool = False) -> int | None:
        """The max_tokens a request runs with, or ContextExceedsCapacity (with the numbers) for one that
        could not run even alone. With `clamp`, a max_tokens beyond what fits after the prompt is lowered
        to what fits, so the reply ends with length there (as llama.cpp, Ollama and LM Studio do: Claude
        Code asks 32,000 of any model); a prompt that leaves no room for one output token is refused."""
        room = self.max_context_tokens - prompt_tokens
        if clamp and max_tokens is not None and max_tokens > room:
            if room < 1:  # no max_tokens would help: say so, not "prompt + max_tokens"
                raise ContextExceedsCapacity(
                    f"the prompt ({prompt_tokens} tokens) cannot fit: at most {self.max_context_tokens} tokens "
                    "fit, the prompt and at least one output token", prompt_tokens=prompt_tokens,
                    max_tokens=max_tokens, retryable=False, **self.numbers())
            return room
        total = prompt_tokens + (max_tokens or 1)
        if total <= self.context_length and self.need_bytes(total) <= self.capacity_bytes:
            return max_tokens
        why = "the model's context" if total > self.context_length else "the memory ceiling"
        raise ContextExceedsCapacity(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens or 1}) can never fit: limited by {why}; "
            f"at most {self.max_context_tokens} tokens fit",
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            retryable=False,
            **self.numbers(),
        )

    def numbers(self) -> dict:
        d = asdict(self)
        d.update(capacity_bytes=self.capacity_bytes, max_context_tokens=self.max_context_tokens)
        d.pop("context_length")
        return d


def measured() -> dict:
    """MLX's own counters, for reports and the estimate-vs-measured test."""
    return {"active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory(), "cache_bytes": mx.get_cache_memory()}


def _activation_itemsize(model) -> int:
    for _, v in tree_flatten(model.parameters()):
        if mx.issubdtype(v.dtype, mx.floating):
            return v.dtype.size
    return 2

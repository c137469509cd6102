"""Per-request sampling parameters and the sampler built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, make_sampler

from prefixtrace.errors import InvalidRequest


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None  # None: up to the model's context, capped by the engine
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (benchmarks)

    def __post_init__(self):
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequest(f"temperature must be in [0, 2], got {self.temperature}", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop must be up to 16 non-empty strings", param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_sampler(self):
        """A sampler for one row. Greedy rows share one function so a batch of
        them samples in a single argmax; seeded rows carry their own RNG key so
        their draws do not depend on what else is in the batch."""
        if self.greedy:
            return GREEDY
        if self.seed is not None:
            return SeededSampler(self.temperature, self.top_p, self.seed)
        # mlx-lm treats top_p == 0 (not 1) as "off"; 1.0 would also keep everything,
        # but only after a sort over the vocabulary on every step.
        return make_sampler(temp=self.temperature, top_p=0.0 if self.top_p >= 1.0 else self.top_p)


def GREEDY(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class SeededSampler:
    """Temperature/top-p sampling from a private key chain.

    mlx-lm's samplers draw from MLX's global RNG, which every row of a batch
    (and every request before it) advances; a per-row key makes `seed` mean the
    same output alone or batched.
    """

    def __init__(self, temperature: float, top_p: float, seed: int):
        self.temperature = temperature
        self.top_p = top_p
        self.key = mx.random.key(seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self.key, draw = mx.random.split(self.key)
        if self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=draw)

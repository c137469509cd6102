"""Per-request sampling parameters and the sampler built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, make_logits_processors, make_sampler

from prefixtrace.errors import InvalidRequest


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None  # None: up to the model's context, capped by the engine
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (benchmarks)
    presence_penalty: float = 0.0  # OpenAI's, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI's, in [-2, 2]
    repetition_penalty: float = 1.0  # vLLM's extension, > 0; 1 is off

    def __post_init__(self):
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequest(f"temperature must be in [0, 2], got {self.temperature}", param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequest("stop must be up to 16 non-empty strings", param="stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}", param=name)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequest(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
                                 param="repetition_penalty")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def make_penalties(self) -> list:
        """The row's penalty processor, or none (a row without one keeps GenerationBatch's fast path)."""
        return [GeneratedTokenPenalties(self)] if self.penalized else []

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


class GeneratedTokenPenalties:
    """Presence, frequency and repetition penalties over the tokens this reply has generated.

    The arithmetic is mlx-lm's (`make_logits_processors`); what is ours is the window: mlx-lm's
    processors look at the last N tokens of whatever they are given, and the engine hands a row's
    processors its prompt and output together (as GenerationBatch does). Over the prompt, a penalty
    pushes the model away from the very tokens it was just asked to copy (the path a user named, the
    tool's name), so, as vLLM does for presence and frequency, only the output counts here.
    """

    WINDOW = 4096  # output tokens looked back at: the whole reply, for any reply a penalty is set on

    def __init__(self, params: SamplingParams):
        self._processors = make_logits_processors(
            repetition_penalty=None if params.repetition_penalty == 1.0 else params.repetition_penalty,
            repetition_context_size=self.WINDOW,
            presence_penalty=params.presence_penalty or None, presence_context_size=self.WINDOW,
            frequency_penalty=params.frequency_penalty or None, frequency_context_size=self.WINDOW)
        self._prompt_len: int | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._prompt_len is None:  # the first call sees the prompt alone
            self._prompt_len = tokens.shape[0]
        generated = tokens[self._prompt_len:]
        if generated.shape[0] == 0:
            return logits
        for processor in self._processors:
            logits = processor(generated, logits)
        return logits


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

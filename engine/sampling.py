"""The sampler and the penalty processors of one row, built from its request's `SamplingParams`
(prefixtrace/wire/sampling.py: the settings and their ranges, checked where the request is parsed)."""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, make_logits_processors
from mlx_lm.sample_utils import make_sampler as make_mlx_sampler

from prefixtrace.wire.sampling import SamplingParams

__all__ = ["SamplingParams", "make_sampler", "make_penalties", "GeneratedTokenPenalties", "GREEDY", "SeededSampler"]


def make_penalties(params: SamplingParams) -> list:
    """The row's penalty processor, or none (a row without one keeps GenerationBatch's fast path)."""
    penalized = params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
    return [GeneratedTokenPenalties(params)] if penalized else []


def make_sampler(params: SamplingParams):
    """A sampler for one row. Greedy rows share one sampler (GREEDY) so a batch of
    them samples in a single argmax; seeded rows carry their own RNG key so
    their draws do not depend on what else is in the batch."""
    if params.temperature == 0.0:
        return GREEDY
    if params.seed is not None:
        return SeededSampler(params.temperature, params.top_p, params.seed)
    # mlx-lm treats top_p == 0 (not 1) as "off"; 1.0 would also keep everything,
    # but only after a sort over the vocabulary on every step.
    return make_mlx_sampler(temp=params.temperature, top_p=0.0 if params.top_p >= 1.0 else params.top_p)


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


# Every greedy row's sampler: one object, so a batch of them samples in one argmax (GenerationBatch
# calls a sampler its rows share once for the whole batch).
GREEDY = functools.partial(mx.argmax, axis=-1)


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

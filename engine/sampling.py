"""Per-request sampling parameters and the sampler built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from mlx_lm.sample_utils import make_sampler

from prefixtrace.errors import InvalidRequest


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None  # None: up to the model's context, capped by the engine
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

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
        # mlx-lm treats top_p == 0 (not 1) as "off"; 1.0 would also keep everything,
        # but only after a sort over the vocabulary on every step.
        return make_sampler(temp=self.temperature, top_p=0.0 if self.top_p >= 1.0 else self.top_p)

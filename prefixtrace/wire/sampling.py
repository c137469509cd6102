"""A request's sampling settings and their valid ranges, in plain Python.

Every protocol's request is checked against these ranges once, when the proxy parses it, whichever
backend then serves it; the embedded engine builds its samplers and penalty processors from the same
object (engine/sampling.py), so an upstream-mode proxy validates a request without importing MLX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixtrace.common.errors import InvalidRequest


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


"""A tuning knob of the decode kernels: one value of a fixed set, read from an environment variable once.

Why one class: the kernels' variants and unrolls (engine/decode_attention.py, engine/tq_mma.py,
engine/dense_mma.py) all follow the same rule — the environment is read on first use, an unknown value
falls back to the measured default rather than failing a serve, and benchmarks and tests switch the value
in-process with `set`, which refuses a value outside the set. Written once here instead of a global and
two functions per knob.
"""

from __future__ import annotations

import os
from typing import Callable, Generic, TypeVar

__all__ = ["EnvChoice"]

V = TypeVar("V")


class EnvChoice(Generic[V]):
    """The value of `env` if it names one of `choices` (compared as text), else `default`; `what` names
    the knob in the error `set` raises; `on_set` runs after every `set` (e.g. to drop a cached plan)."""

    def __init__(self, env: str, choices: tuple[V, ...], default: V, what: str,
                 on_set: Callable[[], None] | None = None):
        assert default in choices
        self.env, self.choices, self.default, self.what = env, choices, default, what
        self._on_set = on_set
        self._value: V | None = None

    def get(self) -> V:
        if self._value is None:
            raw = os.environ.get(self.env)
            self._value = next((c for c in self.choices if str(c) == raw), self.default)
        return self._value

    def set(self, new: V) -> None:
        if new not in self.choices:
            raise ValueError(f"{self.what} must be one of {self.choices}, not {new!r}")
        self._value = new
        if self._on_set is not None:
            self._on_set()

    def reread(self) -> None:
        """Forget the value: the next `get` reads the environment again (tests)."""
        self._value = None

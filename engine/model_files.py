"""Load an mlx-lm model directory (placeholder until engine.cpu_runtime lands)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import load


def load_model(path: Path, dtype: str | None):
    model, tokenizer, config = load(str(path), return_config=True)
    if dtype is not None:
        target = getattr(mx, dtype)
        model.set_dtype(target, predicate=lambda d: mx.issubdtype(d, mx.floating))
    return model, tokenizer, config

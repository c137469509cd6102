"""Load an mlx-lm model directory for the engine: model, tokenizer and its config."""

from __future__ import annotations

import json
from pathlib import Path

from engine.cpu_runtime import load_model


def load_model_dir(path: Path, dtype: str | None):
    """(model, tokenizer, config); dtype and weight layout as `cpu_runtime.load_model` picks them."""
    model, tokenizer = load_model(path, dtype)
    config = json.loads((Path(path) / "config.json").read_text())
    return model, tokenizer, config

"""bench/bench_tq_attention.py's queued mode (what an engine token does: L layers queued, one eval)
on the CPU, where the kernels are absent and the TurboQuant figure is the MLX-ops path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_tq_attention", ROOT / "bench" / "bench_tq_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_queued_layers_caps_what_the_dense_caches_would_take():
    b = _bench()
    # one Qwen3-8B layer at 100k, bf16: 2 x 8 x 100k x 128 x 2 B = 410 MB; 8 rows: 3.3 GB
    assert b.queued_layers(100_000, 1, 8, 128, mx.bfloat16, 36, 40.0) == 36
    assert b.queued_layers(100_000, 8, 8, 128, mx.bfloat16, 36, 40.0) == 12
    assert b.queued_layers(10**9, 8, 8, 128, mx.bfloat16, 36, 1.0) == 1


def test_queued_mode_reports_per_layer_figures_beside_the_synced_ones():
    b = _bench()
    row = b.measure("smollm2-135m", 200, 4, mx.float32, steps=4, rows=2, queued=3)
    assert row["queued_layers"] == 3
    assert row["queued_dense_ms"] > 0 and row["queued_tq_mlx_ops_ms"] > 0 and row["dense_ms"] > 0
    only = b.measure("smollm2-135m", 200, 4, mx.float32, steps=4, rows=1, queued=2, only_queued=True)
    assert "dense_ms" not in only and only["queued_dense_ms"] > 0


def test_queued_chain_feeds_each_layer_the_previous_output():
    """The queued token is a dependency chain (a layer's output is the next one's query), so the
    time covers L steps in order; with one layer it is one synced step's work."""
    from mlx_lm.models.cache import KVCache

    b = _bench()
    made = []

    def make():
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, 8, 4)), mx.zeros((1, 1, 8, 4)))
        made.append(c)
        return c

    t = b.queued_step_time(make, "dense", 3, 2, 1, 4, mx.float32, steps=4)
    assert t > 0 and len(made) == 3 and all(c.offset == 8 + 4 for c in made)

"""Spilled KV comes back bit for bit, dense and TurboQuant."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engine.spill import SpillStore
from engine.tq_cache import TurboQuantKVCache


def test_dense_and_turboquant_layers_round_trip_exactly(tmp_path):
    mx.random.seed(0)
    dense = KVCache()
    dense.update_and_fetch(mx.random.normal((1, 2, 300, 16)), mx.random.normal((1, 2, 300, 16)))
    tq = TurboQuantKVCache(kv_bits=4, seed=0)
    k, v = mx.random.normal((1, 2, 150, 16)), mx.random.normal((1, 2, 150, 16))
    before_k, before_v = tq.update_and_fetch(k, v)
    store = SpillStore(tmp_path)
    dense_back, tq_back = store.restore(store.spill("row", [dense, tq]))
    assert dense_back.offset == 300 and mx.array_equal(dense_back.keys, dense.keys[..., :300, :]).item()
    assert tq_back.offset == tq.offset
    probe_k, probe_v = mx.random.normal((1, 2, 1, 16)), mx.random.normal((1, 2, 1, 16))
    a = tq.update_and_fetch(probe_k, probe_v)
    b = tq_back.update_and_fetch(probe_k, probe_v)
    assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item()
    assert not list(tmp_path.iterdir())  # the file is gone once restored


def test_no_directory_until_the_first_spill_and_none_after_close(tmp_path, monkeypatch):
    """A store of its own makes its temp directory on the first spill, not at start (every stopped
    `serve` left an empty `prefixtrace-spill-*` behind), and `close()` removes it with what it holds."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    store = SpillStore()
    assert list(tmp_path.iterdir()) == []
    layer = KVCache()
    layer.update_and_fetch(mx.ones((1, 2, 3, 4)), mx.ones((1, 2, 3, 4)))
    path = store.spill("r1", [layer])
    assert path.parent.parent == tmp_path and path.parent.name.startswith("prefixtrace-spill-")
    store.close()
    assert list(tmp_path.iterdir()) == []


def test_a_given_directory_is_left_where_it_is(tmp_path):
    store = SpillStore(tmp_path / "mine")
    store.close()
    assert (tmp_path / "mine").is_dir()

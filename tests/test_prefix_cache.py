"""The paged prefix cache on the tiny fixture model: exact reuse, tiers, budgets, pins, commits."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.block_hash import block_hashes, chain_hash, root_hash
from engine.model_files import load_model
from engine.prefix_cache import PrefixCache
from tests.conftest import TINY_MODEL

BS = 16


@pytest.fixture(scope="module")
def model():
    return load_model(TINY_MODEL, "float32")[0]


def prefill(model, tokens):
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


def same_kv(cache, ref, n):
    return all(
        c.offset == n and mx.array_equal(c.keys, r.keys[..., :n, :]).item() and mx.array_equal(c.values, r.values[..., :n, :]).item()
        for c, r in zip(cache, ref)
    )


def make(model, tmp_path=None, **kw):
    kw.setdefault("max_bytes", 1 << 30)
    kw.setdefault("block_size", BS)
    if tmp_path is not None:
        kw.update(cache_dir=tmp_path / "kv", model_dir=TINY_MODEL)
    return PrefixCache(model, **kw)


PROMPT = [(7 * i) % 500 + 3 for i in range(100)]  # 6 full blocks of 16 and a 4-token tail


def test_block_hashes_chain_and_bind_to_model_and_format():
    keys = block_hashes(PROMPT, BS, model_fingerprint="m", cache_format="dense/float32")
    assert len(keys) == 100 // BS
    root = root_hash(model_fingerprint="m", cache_format="dense/float32")
    assert keys[1] == chain_hash(chain_hash(root, PROMPT[:BS]), PROMPT[BS : 2 * BS])
    assert block_hashes(PROMPT[:40], BS, model_fingerprint="m", cache_format="dense/float32") == keys[:2]
    assert block_hashes(PROMPT, BS, model_fingerprint="m2", cache_format="dense/float32")[0] != keys[0]
    assert block_hashes(PROMPT, BS, model_fingerprint="m", cache_format="tq4/float16")[0] != keys[0]
    edited = PROMPT[:20] + [1] + PROMPT[21:]
    other = block_hashes(edited, BS, model_fingerprint="m", cache_format="dense/float32")
    assert other[0] == keys[0] and all(a != b for a, b in zip(other[1:], keys[1:]))


def test_block_hash_module_does_not_import_mlx():
    code = "import sys, engine.block_hash; print(any(m.startswith('mlx') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("common", [0, 5, 16, 37, 96, 99])
def test_lookup_reuses_exactly_the_common_prefix(model, common):
    pc = make(model)
    ref = prefill(model, PROMPT)
    pc.store(PROMPT, prefill(model, PROMPT))
    query = PROMPT[:common] + [499, 498, 497]
    hit = pc.lookup(query)
    assert hit.num_cached == common
    if common:
        assert same_kv(hit.cache, ref, common)


def test_lookup_never_covers_the_whole_prompt(model):
    pc = make(model)
    pc.store(PROMPT, prefill(model, PROMPT))
    assert pc.lookup(PROMPT).num_cached == 99
    assert pc.lookup(PROMPT[:48]).num_cached == 47  # a full block boundary gives one back too
    assert pc.lookup(PROMPT + [5, 6]).num_cached == 100


def test_longer_sequence_supersedes_its_own_tail(model):
    pc = make(model)
    pc.store(PROMPT[:90], prefill(model, PROMPT[:90]))
    pc.store(PROMPT, prefill(model, PROMPT))
    # the 90-token sequence's tail (block 5's first 10 tokens) was dropped for the full block 5
    assert pc.stats["memory_blocks"] == 7
    assert pc.lookup(PROMPT + [1]).num_cached == 100
    assert pc.lookup(PROMPT[:95] + [1]).num_cached == 95


def test_memory_budget_evicts_leaves_first(model):
    probe = make(model)
    probe.store(PROMPT[:BS], prefill(model, PROMPT[:BS]))
    one_block = probe.nbytes
    pc = make(model, max_bytes=4 * one_block)
    pc.store(PROMPT, prefill(model, PROMPT))
    assert pc.nbytes <= 4 * one_block
    # the chain's head survives: the first blocks are hit, the later ones were evicted
    assert pc.lookup(PROMPT + [1]).num_cached == 4 * BS


def test_pinned_blocks_survive_eviction(model):
    probe = make(model)
    probe.store(PROMPT[:BS], prefill(model, PROMPT[:BS]))
    one_block = probe.nbytes
    pc = make(model, max_bytes=3 * one_block)
    a = PROMPT[:48]
    pc.store(a, prefill(model, a))
    assert pc.pin(a) == 48
    b = [(t + 101) % 500 + 3 for t in PROMPT[:48]]
    pc.store(b, prefill(model, b))
    assert pc.lookup(a + [1]).num_cached == 48
    pc.unpin(a)
    pc.store(b, prefill(model, b))
    c = [(t + 203) % 500 + 3 for t in PROMPT[:48]]
    pc.store(c, prefill(model, c))
    assert pc.lookup(a + [1]).num_cached < 48


def test_commit_keeps_full_blocks_every_k_and_copies(model):
    pc = make(model, commit_blocks=2)
    cache = prefill(model, PROMPT[:20])  # one full block: not yet
    pc.commit(PROMPT[:20], cache)
    assert len(pc) == 0
    model(mx.array(PROMPT[20:40])[None], cache=cache)  # two full blocks now
    pc.commit(PROMPT[:40], cache)
    assert len(pc) == 2
    pc.commit(PROMPT[:40], cache)  # nothing new: no change
    assert len(pc) == 2
    assert cache[0].offset == 40  # the caller's cache is untouched and still usable
    model(mx.array(PROMPT[40:50])[None], cache=cache)
    assert cache[0].offset == 50
    hit = pc.lookup(PROMPT)
    assert hit.num_cached == 32
    assert same_kv(hit.cache, prefill(model, PROMPT), 32)


def test_disk_tier_restores_exact_kv_after_restart(model, tmp_path):
    pc = make(model, tmp_path)
    pc.store(PROMPT, prefill(model, PROMPT))
    pc.close()
    fresh = make(model, tmp_path)
    assert len(fresh) == 0 and fresh.stats["disk_blocks"] == 7
    hit = fresh.lookup(PROMPT + [9])
    assert hit.num_cached == 100
    assert fresh.stats["disk_blocks_read"] == 7
    assert same_kv(hit.cache, prefill(model, PROMPT), 100)
    fresh.close()


def test_disk_tier_lru_by_size_and_pins(model, tmp_path):
    pc = make(model, tmp_path)
    pc.store(PROMPT[:BS], prefill(model, PROMPT[:BS]))
    pc.flush()
    block_file = pc.stats["disk_bytes"]
    pc.close()
    pc = make(model, tmp_path, disk_bytes=int(3.5 * block_file))
    pc.pin(PROMPT[:BS])
    pc.store(PROMPT, prefill(model, PROMPT))
    pc.flush()
    assert pc.stats["disk_bytes"] <= 3.5 * block_file
    pc.close()
    again = make(model, tmp_path, max_bytes=1 << 30)
    assert again.lookup(PROMPT + [1]).num_cached >= BS  # the pinned head block is still there
    again.close()


def test_flush_waits_for_the_first_disk_write(model, tmp_path):
    # An empty DiskCache is falsy (it has __len__): flush must still wait for it.
    import time
    pc = make(model, tmp_path)
    write = pc.disk._write
    pc.disk._write = lambda *a: (time.sleep(0.2), write(*a))
    pc.store(PROMPT[:BS], prefill(model, PROMPT[:BS]))
    pc.flush()
    assert pc.stats["disk_blocks"] == 1 and pc.stats["disk_bytes"] > 0
    pc.close()

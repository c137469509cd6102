"""The disk tier under damage: truncated or corrupted block files are misses plus one log line."""

from __future__ import annotations

import logging

import pytest

from engine.prefix_cache import PrefixCache
from tests.conftest import TINY_MODEL
from tests.test_prefix_cache import BS, PROMPT, prefill, same_kv


@pytest.fixture(scope="module")
def model():
    from engine.model_files import load_model

    return load_model(TINY_MODEL, "float32")[0]


def on_disk(model, tmp_path):
    pc = PrefixCache(model, max_bytes=1 << 30, block_size=BS, cache_dir=tmp_path, model_dir=TINY_MODEL)
    pc.store(PROMPT, prefill(model, PROMPT))
    pc.close()
    return PrefixCache(model, max_bytes=1 << 30, block_size=BS, cache_dir=tmp_path, model_dir=TINY_MODEL)


def block_file(pc, index):
    return pc.disk._path(pc._chain(PROMPT)[index])


def damaged(kind, path):
    data = bytearray(path.read_bytes())
    if kind == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif kind == "payload":
        data[-100] ^= 0x01
        path.write_bytes(bytes(data))
    else:  # a header byte: inside the token list of the JSON
        data[data.index(b'"tokens":[') + 11] ^= 0x01
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["truncate", "payload", "header"])
def test_damaged_block_read_is_a_miss_and_one_log_line(model, tmp_path, caplog, kind):
    pc = on_disk(model, tmp_path)
    path = block_file(pc, 3)
    damaged(kind, path)
    with caplog.at_level(logging.WARNING, logger="prefixtrace.cache"):
        hit = pc.lookup(PROMPT + [1])
    assert hit.num_cached == 3 * BS  # the blocks before the damaged one still serve
    assert same_kv(hit.cache, prefill(model, PROMPT), 3 * BS)
    assert len([r for r in caplog.records if "corrupt" in r.message]) == 1
    assert not path.exists()
    assert pc.lookup(PROMPT + [1]).num_cached == 3 * BS  # and it stays a plain miss
    pc.close()


def test_truncated_file_found_at_start_is_dropped_with_one_log_line(model, tmp_path, caplog):
    pc = on_disk(model, tmp_path)
    path = block_file(pc, 0)
    pc.close()
    damaged("truncate", path)
    (path.parent / ".leftover.blk.tmp").write_bytes(b"half a write")
    with caplog.at_level(logging.WARNING, logger="prefixtrace.cache"):
        fresh = PrefixCache(model, max_bytes=1 << 30, block_size=BS, cache_dir=tmp_path, model_dir=TINY_MODEL)
    assert len([r for r in caplog.records if "corrupt" in r.message]) == 1
    assert fresh.stats["disk_blocks"] == 6
    assert fresh.lookup(PROMPT + [1]).num_cached == 0  # the chain's head is gone: nothing is reachable
    assert not (path.parent / ".leftover.blk.tmp").exists()
    fresh.close()


def test_other_model_or_format_never_hits(model, tmp_path):
    pc = on_disk(model, tmp_path)
    pc.close()
    other_dir = tmp_path / "other-model"
    other_dir.mkdir()
    (other_dir / "config.json").write_text('{"model_type": "llama", "hidden_size": 65}')
    other = PrefixCache(model, max_bytes=1 << 30, block_size=BS, cache_dir=tmp_path, model_dir=other_dir)
    assert other.lookup(PROMPT + [1]).num_cached == 0
    other.close()

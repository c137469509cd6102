"""The disk tier under damage: truncated or corrupted block files are misses plus one log line.

Also the chain read ahead (DiskCache.get_many): restored bytes equal what was
stored (every dtype, bfloat16 through its bit patterns), and a walk that stops
early leaves the blocks after it as they were.
"""

from __future__ import annotations

import json
import logging
import os
import zlib

import mlx.core as mx
import pytest

from engine import disk_cache
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


def rewrite_header(path, edit):
    """Edit a block file's header and re-frame it with a valid checksum: damage the CRC cannot catch."""
    data = path.read_bytes()
    hlen = int.from_bytes(data[8:12], "little")
    header = json.loads(data[12 : 12 + hlen])
    edit(header)
    raw = json.dumps(header).encode()
    body = raw + data[12 + hlen : -4]
    path.write_bytes(data[:8] + len(raw).to_bytes(4, "little") + body + zlib.crc32(body).to_bytes(4, "little"))


@pytest.mark.parametrize("edit", [
    lambda h: h.pop("key"),
    lambda h: h["arrays"][3].pop("offset"),
    lambda h: h["arrays"][0].update(offset=h["payload_bytes"]),
    lambda h: h["arrays"][0].update(np="<zz"),
])
def test_checksummed_but_malformed_header_is_a_miss_not_a_crash(model, tmp_path, caplog, edit):
    pc = on_disk(model, tmp_path)
    path = block_file(pc, 2)
    rewrite_header(path, edit)
    with caplog.at_level(logging.WARNING, logger="prefixtrace.cache"):
        hit = pc.lookup(PROMPT + [1])
    assert hit.num_cached == 2 * BS
    assert same_kv(hit.cache, prefill(model, PROMPT), 2 * BS)
    assert len([r for r in caplog.records if "corrupt" in r.message]) == 1
    pc.close()


def test_restored_bytes_equal_the_stored_ones_bit_for_bit(tmp_path):
    from engine.model_files import load_model

    for dtype in ("float32", "bfloat16"):
        model = load_model(TINY_MODEL, dtype)[0]
        pc = PrefixCache(model, max_bytes=1 << 30, block_size=BS, cache_dir=tmp_path / dtype, model_dir=TINY_MODEL)
        ref = prefill(model, PROMPT)
        pc.store(PROMPT, prefill(model, PROMPT))
        pc.close()
        fresh = PrefixCache(model, max_bytes=1 << 30, block_size=BS, cache_dir=tmp_path / dtype, model_dir=TINY_MODEL)
        hit = fresh.lookup(PROMPT + [1])
        assert hit.num_cached == 100 and fresh.stats["disk_blocks_read"] == 7
        for c, r in zip(hit.cache, ref):
            assert c.keys.dtype == r.keys.dtype == getattr(mx, dtype)
            bits = mx.uint16 if dtype == "bfloat16" else mx.uint32
            assert mx.array_equal(c.keys.view(bits), r.keys[..., :100, :].view(bits)).item()
            assert mx.array_equal(c.values.view(bits), r.values[..., :100, :].view(bits)).item()
        # and the blocks promoted to memory serve the same bytes again
        again = fresh.lookup(PROMPT + [1])
        assert fresh.stats["disk_blocks_read"] == 7 and same_kv(again.cache, ref, 100)
        fresh.close()


def test_walk_that_stops_early_leaves_the_blocks_read_ahead_untouched(model, tmp_path, monkeypatch):
    pc = on_disk(model, tmp_path)
    # three files in flight at most: the window refills as blocks are taken
    monkeypatch.setattr(disk_cache, "READ_AHEAD_BYTES", 3 * pc.disk._size(pc._chain(PROMPT)[0]))
    keys = pc._chain(PROMPT)
    old = 1_000_000_000
    for key in keys:
        os.utime(pc.disk._path(key), ns=(old, old))
    os.remove(pc.disk._path(keys[4]))  # vanished under the reader (as by another process): a plain miss
    order = list(pc.disk._index)
    hit = pc.lookup(PROMPT + [1])
    assert hit.num_cached == 4 * BS and pc.stats["disk_corrupt"] == 0
    assert same_kv(hit.cache, prefill(model, PROMPT), 4 * BS)
    # blocks 0-3 were used: touched (file mtime and index order); block 5 was read ahead but not used
    assert all(pc.disk._path(k).stat().st_mtime_ns > old for k in keys[:4])
    assert pc.disk._path(keys[5]).stat().st_mtime_ns == old
    assert keys[4] not in pc.disk
    assert [k for k in pc.disk._index if k not in keys[:4]] == [k for k in order if k not in keys[:5]]
    pc.close()

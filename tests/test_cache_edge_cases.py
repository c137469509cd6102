"""Edge cases of the prefix cache tiers, as a demanding user hits them.

Disk: headers that pass the checksum but lie, arrays that cannot be turned back
into a layer, a read-only cache directory, a cache directory removed while the
engine runs, budgets smaller than one block, files deleted under the engine.
Memory: `num_cached` is exactly the longest common prefix with what is cached
around block boundaries, and the byte budget holds. Engine: damaged and foreign
files in the cache directory of a restarted engine are misses, and its greedy
output equals a cold run's.
"""

from __future__ import annotations

import logging
import os
import pathlib

import mlx.core as mx
import numpy as np
import pytest

from engine.block_hash import chain_hash
from engine.disk_cache import MAGIC
from engine.prefix_cache import PrefixCache
from tests.conftest import TINY_MODEL
from tests.test_cache_disk import rewrite_header
from tests.test_prefix_cache import BS, PROMPT, prefill, same_kv


@pytest.fixture(scope="module")
def model():
    from engine.model_files import load_model

    return load_model(TINY_MODEL, "float32")[0]


def make(model, cache_dir=None, **kw):
    kw.setdefault("max_bytes", 1 << 30)
    kw.setdefault("block_size", BS)
    if cache_dir is not None:
        kw.update(cache_dir=cache_dir, model_dir=TINY_MODEL)
    return PrefixCache(model, **kw)


def stored_then_restarted(model, tmp_path, tokens=PROMPT, **kw):
    pc = make(model, tmp_path, **kw)
    pc.store(tokens, prefill(model, tokens))
    pc.close()
    return make(model, tmp_path, **kw)


def blk_files(root) -> set[pathlib.Path]:
    return set(pathlib.Path(root).glob("*/*.blk"))


# --- disk: checksummed headers that lie --------------------------------------------------------


def test_header_that_lies_about_its_parent_never_serves_wrong_kv(model, tmp_path):
    """Block 1 of PROMPT re-framed (valid CRC) to claim the root as its parent: it would then
    answer, as a child of the root, a prompt that starts with PROMPT[16:32], with KV computed
    after PROMPT[:16]."""
    pc = stored_then_restarted(model, tmp_path)
    root = pc.root.hex()
    path = pc.disk._path(pc._chain(PROMPT)[1])
    pc.close()
    rewrite_header(path, lambda h: h.update(parent=root))
    fresh = make(model, tmp_path)
    other = PROMPT[BS : 2 * BS] + [5, 6, 7]
    assert fresh.stats["disk_corrupt"] == 1  # caught by the scan: its key is not H(parent, tokens)
    assert fresh.lookup(other).num_cached == 0
    hit = fresh.lookup(PROMPT + [1])  # the original prompt keeps the block before it
    assert hit.num_cached == BS and same_kv(hit.cache, prefill(model, PROMPT), BS)
    fresh.close()


def test_header_that_lies_about_its_tokens_is_a_miss(model, tmp_path):
    pc = stored_then_restarted(model, tmp_path)
    keys = pc._chain(PROMPT)
    pc.close()
    lied = PROMPT[BS : 2 * BS][:-1] + [499]
    rewrite_header(pc.disk._path(keys[1]), lambda h: h.update(tokens=lied))
    fresh = make(model, tmp_path)
    query = PROMPT[:BS] + lied + [1, 2]
    hit = fresh.lookup(query)
    assert hit.num_cached == BS  # the lying block is dropped; with the true tokens it would be 2 * BS - 1
    assert same_kv(hit.cache, prefill(model, query), hit.num_cached)
    fresh.close()


@pytest.mark.parametrize("edit", [
    lambda h: h.pop("parent"),
    lambda h: h.pop("tokens"),
    lambda h: h.update(parent="not hex"),
    lambda h: h.update(tokens="abc"),
], ids=["no-parent", "no-tokens", "bad-parent", "bad-tokens"])
def test_header_edited_while_running_is_a_miss_not_a_crash(model, tmp_path, caplog, edit):
    """The index was built from a good header; the file changes under the engine (valid CRC)."""
    pc = stored_then_restarted(model, tmp_path)
    rewrite_header(pc.disk._path(pc._chain(PROMPT)[2]), edit)
    with caplog.at_level(logging.WARNING, logger="prefixtrace.cache"):
        hit = pc.lookup(PROMPT + [1])
    assert hit.num_cached == 2 * BS
    assert same_kv(hit.cache, prefill(model, PROMPT), 2 * BS)
    assert any("prefix cache" in r.message for r in caplog.records)
    pc.close()


def _rename_array(name, new):
    def edit(h):
        for spec in h["arrays"]:
            if spec["name"] == name:
                spec["name"] = new
    return edit


def _v_as_float16(h):
    # "0.v" reinterpreted as float16 with a doubled head_dim: same bytes, same CRC, same position count
    for spec in h["arrays"]:
        if spec["name"] == "0.v":
            spec.update(dtype="float16", np="<f2", shape=[*spec["shape"][:3], spec["shape"][3] * 2])


@pytest.mark.parametrize("edit", [
    _rename_array("0.k", "x.k"),
    _rename_array("0.v", "0.w"),
    lambda h: h["arrays"][0].update(dtype="nosuchdtype"),
    _v_as_float16,
], ids=["layer-name", "missing-v", "unknown-mlx-dtype", "v-dtype-lie"])
def test_arrays_that_do_not_make_a_layer_are_a_miss_not_a_crash(model, tmp_path, edit):
    pc = stored_then_restarted(model, tmp_path)
    rewrite_header(pc.disk._path(pc._chain(PROMPT)[3]), edit)
    hit = pc.lookup(PROMPT + [1])
    assert hit.num_cached == 3 * BS
    assert same_kv(hit.cache, prefill(model, PROMPT), 3 * BS)
    pc.close()


# --- disk: the directory under the engine ------------------------------------------------------


def test_read_only_cache_dir_with_damaged_files_is_a_miss_not_a_crash(model, tmp_path, monkeypatch):
    """A pre-warmed cache shared read-only: damaged files cannot be deleted; they are still misses."""
    pc = stored_then_restarted(model, tmp_path)
    keys = pc._chain(PROMPT)
    pc.close()
    (pc.disk._path(keys[0]).parent / f".{keys[0].hex()}.blk.tmp").write_bytes(b"half a write")
    zero = tmp_path / "ab" / ("ab" + "0" * 30 + ".blk")
    zero.parent.mkdir(exist_ok=True)
    zero.write_bytes(b"")

    def read_only(self, missing_ok=False):
        raise OSError(30, "Read-only file system", str(self))

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    fresh = make(model, tmp_path)  # the scan cannot delete the damaged files: it must still start
    assert fresh.stats["disk_blocks"] == 7
    data = bytearray(fresh.disk._path(keys[4]).read_bytes())
    data[-100] ^= 1
    fresh.disk._path(keys[4]).write_bytes(bytes(data))
    hit = fresh.lookup(PROMPT + [1])
    assert hit.num_cached == 4 * BS and same_kv(hit.cache, prefill(model, PROMPT), 4 * BS)
    fresh.close()


def test_cache_dir_removed_while_running_is_written_again(model, tmp_path):
    import shutil

    root = tmp_path / "kv"
    pc = make(model, root)
    pc.store(PROMPT[:40], prefill(model, PROMPT[:40]))
    pc.flush()
    shutil.rmtree(root)  # the user cleans the cache directory while the engine runs
    other = [t + 1 for t in PROMPT]
    pc.store(other, prefill(model, other))
    pc.flush()
    assert len(blk_files(root)) == 7
    assert pc.lookup(PROMPT[:40] + [1]).num_cached == 40  # still served from memory
    pc.close()
    fresh = make(model, root)
    hit = fresh.lookup(other + [1])
    assert hit.num_cached == 100 and same_kv(hit.cache, prefill(model, other), 100)
    fresh.close()


def test_cache_dir_that_is_a_file_fails_at_start_with_a_clear_error(model, tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    from engine.disk_cache import CacheDirUnusable

    with pytest.raises(CacheDirUnusable, match="cannot be used"):
        make(model, path)


def test_disk_budget_smaller_than_one_block_writes_nothing_and_still_serves(model, tmp_path):
    pc = make(model, tmp_path, disk_bytes=1000)
    pc.store(PROMPT, prefill(model, PROMPT))
    pc.flush()
    assert blk_files(tmp_path) == set() and pc.stats["disk_bytes"] == 0
    hit = pc.lookup(PROMPT + [1])
    assert hit.num_cached == 100 and same_kv(hit.cache, prefill(model, PROMPT), 100)
    pc.close()


def test_disk_budget_holds_and_index_matches_the_files(model, tmp_path):
    probe = make(model, tmp_path / "probe")
    probe.store(PROMPT[:BS], prefill(model, PROMPT[:BS]))
    probe.flush()
    one = probe.stats["disk_bytes"]
    probe.close()
    budget = int(5.5 * one)
    pc = make(model, tmp_path / "kv", disk_bytes=budget, max_bytes=1 << 30)
    for shift in range(4):
        seq = [(t + 37 * shift) % 500 + 3 for t in PROMPT[:50 + 7 * shift]]
        pc.store(seq, prefill(model, seq))
        pc.flush()
        files = blk_files(tmp_path / "kv")
        assert pc.stats["disk_bytes"] <= budget
        assert {f.name for f in files} == {f"{k.hex()}.blk" for k in pc.disk._index}
        assert sum(f.stat().st_size for f in files) == pc.stats["disk_bytes"]
    pc.close()


# --- memory: exactness around block boundaries, budget -----------------------------------------


def _lcp(a, b) -> int:
    return len(os.path.commonprefix([list(a), list(b)]))


def test_num_cached_is_the_exact_longest_common_prefix_around_block_boundaries(model):
    pc = make(model)
    stored = []
    for n in (BS - 1, BS, BS + 1, 2 * BS - 1, 2 * BS, 2 * BS + 1, 3 * BS):
        seq = PROMPT[:n]
        pc.store(seq, prefill(model, seq))
        stored.append(seq)
    branch = PROMPT[:BS + 3] + [411, 412] + PROMPT[BS + 5 : 3 * BS]
    pc.store(branch, prefill(model, branch))
    stored.append(branch)
    ref = {id(s): prefill(model, s) for s in stored}
    for n in range(1, 3 * BS + 3):
        for query in (PROMPT[:n], PROMPT[:n] + [499], branch[:n]):
            hit = pc.lookup(query)
            best = max(stored, key=lambda s: _lcp(s, query[:-1]))
            expected = _lcp(best, query[:-1])
            assert hit.num_cached == expected, (n, query[-3:])
            if expected:
                assert same_kv(hit.cache, ref[id(best)], expected)


def test_memory_budget_is_never_exceeded_and_pins_hold(model):
    probe = make(model)
    probe.store(PROMPT[:BS], prefill(model, PROMPT[:BS]))
    one = probe.nbytes
    budget = int(4.5 * one)
    pc = make(model, max_bytes=budget)
    pinned = PROMPT[:2 * BS]
    pc.store(pinned, prefill(model, pinned))
    pc.pin(pinned)
    for shift in range(1, 6):
        seq = [(t + 53 * shift) % 500 + 3 for t in PROMPT[: 20 + 13 * shift]]
        pc.store(seq, prefill(model, seq))
        assert pc.nbytes <= budget
        assert pc.nbytes == sum(b.nbytes for b in pc.memory._blocks.values())
        assert pc.lookup(pinned + [1]).num_cached == 2 * BS
    pc.unpin(pinned)
    seq = [(t + 401) % 500 + 3 for t in PROMPT]
    pc.store(seq, prefill(model, seq))
    assert pc.nbytes <= budget


# --- engine: a restarted engine over a damaged, foreign-littered cache directory --------------


def test_restarted_engine_over_damaged_cache_dir_matches_cold_output(tmp_path):
    from engine.engine import Engine
    from tests.test_cache_engine import LONG, submit

    def engine(**kw):
        e = Engine(TINY_MODEL, dtype="float32", block_size=BS, **kw).start()
        e.wait_ready(60)
        return e

    first = engine(cache_dir=tmp_path)
    _, done = submit(first, LONG, max_tokens=8)
    first.shutdown()
    keys = first.prefix_cache._chain(first.render(LONG).token_ids)
    files = [first.prefix_cache.disk._path(k) for k in keys]
    assert len(files) > 6
    # damage: a truncated block, a zero-byte one, garbage, and stray files of every kind
    files[3].write_bytes(files[3].read_bytes()[:-7])
    files[5].write_bytes(b"")
    (tmp_path / "zz").mkdir(exist_ok=True)
    (tmp_path / "zz" / ("zz" * 16 + ".blk")).write_bytes(MAGIC + b"\xff\xff\xff\xff garbage")
    (tmp_path / "zz" / "notes.txt").write_text("not a block")
    (tmp_path / "stray.blk").write_bytes(b"top-level stray")

    second = engine(cache_dir=tmp_path)
    warm_seq, warm = submit(second, LONG, max_tokens=8)
    assert warm.cached_tokens == 3 * BS  # the chain stops at the truncated block
    assert second.prefix_cache.stats["disk_corrupt"] == 3
    second.shutdown()
    cold = engine()
    cold_seq, cold_done = submit(cold, LONG, max_tokens=8)
    cold.shutdown()
    assert cold_done.cached_tokens == 0
    assert warm_seq.output_ids == cold_seq.output_ids


def test_pinned_tail_is_not_dropped_for_a_longer_unpinned_one(model):
    """A parked prefill pins its prefix (its tail included). A longer sequence under the same
    parent supersedes that tail; once the longer, unpinned tail is evicted, the pinned prefix
    must still be whole."""
    probe = make(model)
    probe.store(PROMPT[:BS], prefill(model, PROMPT[:BS]))
    one = probe.nbytes
    pc = make(model, max_bytes=int(4.5 * one))
    parked = PROMPT[:40]  # blocks 0, 1 and an 8-token tail
    pc.pin(parked)
    pc.store(parked, prefill(model, parked))
    assert pc.holds(parked)
    longer = PROMPT[:46]  # its 14-token tail begins with the parked one's
    pc.store(longer, prefill(model, longer))
    for shift in (1, 2, 3):  # traffic that evicts every unpinned leaf
        seq = [(t + 71 * shift) % 500 + 3 for t in PROMPT[:2 * BS]]
        pc.store(seq, prefill(model, seq))
    assert pc.holds(parked)
    hit = pc.lookup(parked + [1])
    assert hit.num_cached == 40 and same_kv(hit.cache, prefill(model, parked), 40)
    pc.unpin(parked)


_WRITER = """
import sys
from engine.model_files import load_model
from engine.prefix_cache import PrefixCache
from tests.test_prefix_cache import PROMPT, prefill
model = load_model(sys.argv[2], "float32")[0]
pc = PrefixCache(model, max_bytes=1 << 30, block_size=16, cache_dir=sys.argv[1], model_dir=sys.argv[2])
i = 0
while True:
    seq = [(t + 13 * i) % 500 + 3 for t in PROMPT] + [i % 500]
    pc.store(seq, prefill(model, seq))
    if i == 3:
        pc.flush()
        print("ready", flush=True)
    i += 1
"""


@pytest.mark.slow
def test_restart_after_kill_9_mid_write_restores_only_whole_blocks(model, tmp_path):
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(TINY_MODEL)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # the writer thread is mid-stream
        proc.wait(30)
    fresh = make(model, tmp_path)
    assert not list(tmp_path.glob("*/.*.tmp"))
    assert fresh.stats["disk_blocks"] >= 4 * 7
    for i in range(4):  # every sequence stored before "ready" comes back exactly
        seq = [(t + 13 * i) % 500 + 3 for t in PROMPT] + [i % 500]
        hit = fresh.lookup(seq + [1])
        assert hit.num_cached == len(seq) and same_kv(hit.cache, prefill(model, seq), len(seq))
    assert fresh.stats["disk_corrupt"] == 0
    fresh.close()


def test_identical_prompts_in_flight_match_a_cold_run(tmp_path):
    import queue

    from engine.engine import Engine
    from engine.sampling import SamplingParams
    from engine.sequence import Failed, Finished, Sequence
    from tests.test_cache_engine import LONG

    def engine(**kw):
        e = Engine(TINY_MODEL, dtype="float32", block_size=BS, prefill_step_size=32, **kw).start()
        e.wait_ready(60)
        return e

    warm = engine(cache_dir=tmp_path)
    prompt = warm.render(LONG).token_ids
    events = [queue.Queue() for _ in range(4)]
    seqs = [Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=8), q.put) for q in events]
    warm.submit_all(seqs)  # all at once: one prefills, the rest wait, may join it as a wave or hit its commits
    finished = []
    for q in events:
        while not isinstance(event := q.get(timeout=60), (Finished, Failed)):
            pass
        assert isinstance(event, Finished), event
        finished.append(event)
    stats = warm.prefix_cache.stats
    warm.shutdown()
    cold = engine()
    ref_q: queue.Queue = queue.Queue()
    ref = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=8), ref_q.put)
    cold.submit(ref)
    while not isinstance(ref_q.get(timeout=60), Finished):
        pass
    cold.shutdown()
    assert all(s.output_ids == ref.output_ids for s in seqs)
    assert all(0 <= f.cached_tokens <= len(prompt) - 1 for f in finished)
    assert sum(f.cached_tokens for f in finished) <= stats["hit_tokens"]


def test_turboquant_block_whose_norms_lie_about_their_length_is_a_miss(model, tmp_path):
    """A checksummed TurboQuant block whose norms cover fewer positions than its codes would
    restore a cache whose norms and offset disagree."""
    from engine.tq_config import TQConfig

    tq = TQConfig()
    pc = make(model, tmp_path, tq=tq)
    cache = tq.make_cache(model)
    model(mx.array(PROMPT)[None], cache=cache)
    mx.eval([c.state for c in cache])
    pc.store(PROMPT, cache)
    pc.close()

    def edit(h):
        for spec in h["arrays"]:
            if spec["name"] == "0.kn":
                spec["shape"][2] //= 2
                spec["nbytes"] //= 2

    rewrite_header(pc.disk._path(pc._chain(PROMPT)[5]), edit)
    fresh = make(model, tmp_path, tq=tq)
    hit = fresh.lookup(PROMPT + [1])
    assert hit.num_cached == 5 * BS  # blocks 0-4: codes below 64, block 4 holds 64..80 dense
    assert all(c.offset == hit.num_cached for c in hit.cache)
    tq_layers = [c for c in hit.cache if type(c).__name__ == "TurboQuantKVCache"]
    assert tq_layers and all(a.shape[2] == hit.num_cached for c in tq_layers for a in c.state[:4])
    fresh.close()


def test_a_full_memory_tier_does_not_make_each_commit_copy_the_chain_again(model, tmp_path, monkeypatch):
    """With a memory budget of about one block, every commit of a long prefill found the chain
    uncached from block 1 on (a block counts as cached only in both tiers) and copied all of it
    again: quadratic in the prompt. Blocks already on disk that memory cannot take are skipped."""
    import engine.prefix_cache as prefix_cache

    probe = make(model)
    probe.store(PROMPT[:BS], prefill(model, PROMPT[:BS]))
    one = probe.stats["memory_bytes"]
    copies = []
    real_cut = prefix_cache.cut
    monkeypatch.setattr(prefix_cache, "cut", lambda cache, a, b, **kw: copies.append((a, b)) or real_cut(cache, a, b, **kw))
    pc = make(model, tmp_path, max_bytes=int(1.5 * one), commit_blocks=1)
    tokens = (PROMPT * 3)[:8 * BS]
    cache = prefill(model, tokens)
    for n in range(1, 9):  # a prefill committing one more block per chunk
        pc.commit(tokens[: n * BS], cache)
        pc.flush()
    blocks = {a for a, _ in copies}
    assert len(blocks) == 8  # every block was copied once ...
    assert len(copies) <= 8 + 8  # ... and at most one more (the one memory refuses) per commit; was 29
    hit = make(model, tmp_path, max_bytes=int(1.5 * one)).lookup(tokens + [1])
    assert hit.num_cached == 8 * BS and same_kv(hit.cache, cache, 8 * BS)


def test_a_full_memory_only_tier_copies_each_block_of_a_prefill_once(model, monkeypatch):
    """Memory tier only, budget about one block: memory refuses every block after the first,
    and each commit used to copy (and be refused) every block from the first refused one on
    again: quadratic in the prompt (the 3.2x cold-prefill cost of issue 17 at 32k tokens).
    A refused block is remembered for the rest of the prefill and copied once."""
    import engine.prefix_cache as prefix_cache

    probe = make(model)
    probe.store(PROMPT[:BS], prefill(model, PROMPT[:BS]))
    one = probe.stats["memory_bytes"]
    copies = []
    real_cut = prefix_cache.cut
    monkeypatch.setattr(prefix_cache, "cut", lambda cache, a, b, **kw: copies.append((a, b)) or real_cut(cache, a, b, **kw))
    pc = make(model, max_bytes=int(1.5 * one), commit_blocks=1)
    tokens = (PROMPT * 3)[:8 * BS]
    cache = prefill(model, tokens)
    for n in range(1, 9):
        pc.commit(tokens[: n * BS], cache)
    assert sorted(a for a, _ in copies) == [i * BS for i in range(8)]  # each block once; was 1 + 2 + ... + 7 + 1
    assert pc.lookup(tokens + [1]).num_cached == BS  # what memory could hold still serves


@pytest.mark.parametrize("host_copy", ["cpu", "writer", "flat", "shared"])
def test_gpu_staging_path_writes_the_same_blocks(model, tmp_path, monkeypatch, host_copy):
    """The GPU path of the disk writes (a device copy per block, then a host copy on MLX's
    CPU stream or read by the writer thread; or one flat payload array, which on CUDA the
    driver copies and here MLX reads) runs on the CPU too: forced on here, the blocks
    read back bit for bit after a restart, from commits evaluated lazily with the chunk."""
    import engine.cache_blocks as cache_blocks
    import engine.prefix_cache as prefix_cache

    if host_copy == "flat":
        real = cache_blocks.stage
        monkeypatch.setattr(prefix_cache, "stage", lambda named, copy: real(named, copy=copy, flat=True))
    elif host_copy == "shared":  # new blocks cut straight into their disk payload (cache_blocks.cut_shared)
        monkeypatch.setattr(prefix_cache.PrefixCache, "_shared_staging", lambda self: True)
        monkeypatch.setattr(prefix_cache, "cut", lambda *a, **kw: pytest.fail("a second copy of a new block"))
    else:
        monkeypatch.setattr(cache_blocks, "HOST_COPY", host_copy)
    pc = make(model, tmp_path)
    pc._stage_copy = True
    tokens = (PROMPT * 2)[: 5 * BS + 3]
    cache = prefill(model, tokens)
    for n in range(1, 6):
        mx.eval(pc.commit(tokens[: n * BS], cache, lazy=True))
        pc.settle()
    pc.store(tokens, cache)
    mem = pc.lookup(tokens + [1])  # the memory tier's blocks (views of the payload, for "shared")
    assert mem.num_cached == len(tokens) and same_kv(mem.cache, cache, len(tokens))
    pc.close()
    hit = make(model, tmp_path, max_bytes=0).lookup(tokens + [1])
    assert hit.num_cached == len(tokens) and same_kv(hit.cache, cache, len(tokens))


def test_flat_staging_frames_the_same_file_bytes():
    """A block staged as one flat payload (the CUDA driver-copy path, engine/host_copy.py) is
    framed into exactly the bytes of the per-array path: mixed dtypes (bfloat16 as its bits,
    uint32 codes, float32 norms), payload offsets and header alike. On the CPU there is no
    driver copy: the flat array is read through MLX."""
    from engine import host_copy
    from engine.cache_blocks import FlatBlock, stage
    from engine.disk_cache import encode_header

    assert not host_copy.available()  # CUDA only: a no-op here
    rng = np.random.default_rng(3)
    named = {"0.k": mx.array(rng.standard_normal((1, 2, 5, 8)).astype(np.float32)).astype(mx.bfloat16),
             "0.kc": mx.array(rng.integers(0, 2**32, (1, 2, 5, 3), dtype=np.uint32)),
             "0.kn": mx.array(rng.standard_normal((1, 2, 5, 1)).astype(np.float32)),
             "1.v": mx.array(rng.standard_normal((1, 2, 5, 8)).astype(np.float16))}
    per_array, _ = stage(named, copy=False)
    flat, device = stage(named, copy=True, flat=True)
    assert isinstance(flat, FlatBlock) and flat.address is None and device == [flat.flat]
    mx.eval(device)
    kw = dict(fmt="dense", cache_format="f", key=b"k" * 32, parent=b"p" * 32, tokens=(1, 2, 3, 4, 5))
    h1, b1 = encode_header(arrays=per_array, **kw)
    h2, b2 = encode_header(arrays=flat, **kw)
    assert h1 == h2
    assert b"".join(bytes(b) for b in b1) == b"".join(bytes(b) for b in b2)

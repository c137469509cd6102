"""The paged prefix cache through the Engine API: restart from disk, resume after cancel or failure."""

from __future__ import annotations

import queue

from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.sequence import Failed, Finished, Sequence, TextDelta
from tests.conftest import TINY_MODEL
from tests.test_engine import conversation, run

LONG = [{"role": "system", "content": "You are a careful coding agent. " * 12},
        {"role": "user", "content": "def main(): print('hello')\n" * 10}]


def engine(**kw) -> Engine:
    kw.setdefault("block_size", 16)
    e = Engine(TINY_MODEL, dtype="float32", **kw).start()
    e.wait_ready(60)
    return e


def submit(e: Engine, messages, *, max_tokens=16):
    events: queue.Queue = queue.Queue()
    seq = Sequence(e.render(messages).token_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), events.put)
    e.submit(seq)
    while True:
        event = events.get(timeout=60)
        if isinstance(event, (Finished, Failed)):
            return seq, event
        assert isinstance(event, TextDelta)


def test_restarted_engine_restores_from_disk_and_output_matches_cold(tmp_path):
    first = engine(cache_dir=tmp_path)
    _, done, reply = run(first, conversation("")[:2])
    first.shutdown()  # flushes the disk writer

    second = engine(cache_dir=tmp_path, cache_bytes=1 << 30)
    seq_warm, warm, text_warm = run(second, conversation(reply), max_tokens=40)
    assert warm.cached_tokens >= done.prompt_tokens - 3
    assert second.prefix_cache.stats["disk_blocks_read"] > 0

    cold = engine()
    seq_cold, cold_done, text_cold = run(cold, conversation(reply), max_tokens=40)
    assert cold_done.cached_tokens == 0
    assert seq_warm.output_ids == seq_cold.output_ids and text_warm == text_cold
    second.shutdown()
    cold.shutdown()


def test_cancelled_prefill_resends_from_the_committed_prefix(tmp_path):
    e = engine(prefill_step_size=16)
    cache = e.prefix_cache
    commit, seen = cache.commit, []

    def cancel_after_three_chunks(tokens, kv, **kw):  # runs on the engine thread, inside _prefill_chunk
        blocks = commit(tokens, kv, **kw)
        seen.append(len(tokens))
        if len(seen) == 3:
            target.cancel()
        return blocks

    cache.commit = cancel_after_three_chunks
    prompt = e.render(LONG).token_ids
    assert len(prompt) > 80
    events: queue.Queue = queue.Queue()
    target = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=8), events.put)
    e.submit(target)
    while not isinstance(done := events.get(timeout=60), Finished):
        pass
    assert done.finish_reason == "cancelled" and done.completion_tokens == 0
    cache.commit = commit
    resent, again = submit(e, LONG)
    assert again.cached_tokens == seen[2] == 48
    cold = engine()
    reference, _ = submit(cold, LONG)
    assert resent.output_ids == reference.output_ids
    e.shutdown()
    cold.shutdown()


def test_failed_prefill_keeps_its_committed_blocks(tmp_path):
    """No store happens when a step fails: only the commits during prefill survive."""
    e = engine(prefill_step_size=16, cache_dir=tmp_path)
    cache = e.prefix_cache
    commit, seen = cache.commit, []

    def fail_after_four_chunks(tokens, kv, **kw):
        commit(tokens, kv, **kw)  # its blocks are never evaluated by the failed step: settled later
        seen.append(len(tokens))
        if len(seen) == 4:
            raise RuntimeError("simulated abort mid-prefill")

    cache.commit = fail_after_four_chunks
    _, failed = submit(e, LONG)
    assert isinstance(failed, Failed)
    cache.commit = commit
    e.shutdown()

    restarted = engine(cache_dir=tmp_path, prefill_step_size=16)
    resent, again = submit(restarted, LONG)
    assert again.cached_tokens == 64  # four chunks of 16 = four committed blocks
    cold = engine()
    reference, _ = submit(cold, LONG)
    assert resent.output_ids == reference.output_ids
    restarted.shutdown()
    cold.shutdown()


def test_the_end_of_a_sequence_carries_the_prefix_cache_evictions_so_far():
    sizing = engine()
    block_bytes = 16 * sizing.memory.kv_bytes_per_token
    sizing.shutdown()
    e = engine(cache_bytes=3 * block_bytes)  # three blocks: the next prompt's push the first one's out
    try:
        _, first = submit(e, LONG, max_tokens=4)
        _, second = submit(e, [{"role": "user", "content": "class Cache:\n    pass\n" * 20}], max_tokens=4)
        assert first.cache_evictions is not None and second.cache_evictions > first.cache_evictions
        assert second.cache_evictions == e.prefix_cache.evictions
    finally:
        e.shutdown()

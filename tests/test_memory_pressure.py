"""Memory pressure on the tiny model (float32): pause and resume instead of abort."""

from __future__ import annotations

import queue
import threading
import time

import mlx.core as mx
import pytest

from engine.engine import Engine
from engine.memory import MemoryModel
from engine.sampling import SamplingParams
from engine.sequence import Failed, Finished, Sequence, TextDelta
from prefixtrace.common.errors import ContextExceedsCapacity
from tests.conftest import TINY_MODEL
from testsupport.forced_pauses import forced_pauses


def engine_with(**kwargs) -> Engine:
    engine = Engine(TINY_MODEL, dtype="float32", **kwargs).start()
    engine.wait_ready(60)
    return engine


def submit(engine: Engine, prompt_ids, params: SamplingParams, pause_at=()):
    events: queue.Queue = queue.Queue()
    seq = Sequence(list(prompt_ids), params, events.put, record_logprobs=True)
    forced_pauses(engine).add(seq, pause_at=pause_at)
    engine.submit(seq)
    return seq, events


def wait(events: queue.Queue):
    text = []
    while True:
        event = events.get(timeout=120)
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, (Finished, Failed)):
            return "".join(text), event


def prompt(engine: Engine, words: int, topic: str) -> list[int]:
    return engine.render([{"role": "user", "content": f"{topic}: " + "read the file and fix the bug " * words}]).token_ids


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=240, ignore_eos=True),
                                    SamplingParams(temperature=0.9, seed=5, max_tokens=240, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_forced_pauses_leave_the_output_token_identical(params):
    engine = engine_with()
    ids = prompt(engine, 20, "pause")
    ref, ref_events = submit(engine, ids, params)
    ref_text, _ = wait(ref_events)
    seq, events = submit(engine, ids, SamplingParams(**{f: getattr(params, f) for f in params.__slots__}),
                         pause_at=(10, 33, 104, 170))
    text, done = wait(events)
    assert isinstance(done, Finished) and done.finish_reason == "length"
    assert seq.num_pauses == 4 and engine.stats["resumes"] == 4
    assert seq.output_ids == ref.output_ids
    assert seq.token_logprobs == ref.token_logprobs  # bit-identical, not just the same argmax
    assert text == ref_text
    engine.shutdown()


@pytest.mark.slow
def test_concurrent_long_prompts_under_a_small_ceiling_all_complete_identically(caplog):
    probe = engine_with()
    mm = probe.memory
    prompts = [prompt(probe, 45, t) for t in ("alpha", "beta", "gamma")]
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    solo = []
    for ids in prompts:
        seq, events = submit(probe, ids, params)
        wait(events)
        solo.append(seq.output_ids)
    probe.shutdown()

    # A ceiling that holds one request at its final length, not three.
    one = MemoryModel.for_model(probe.model, context_length=mm.context_length, prefill_chunk=16)
    final = one.need_bytes(max(len(p) for p in prompts) + 500)
    engine = engine_with(prefill_step_size=16, memory_ceiling_bytes=one.weights_bytes + int(final * 1.25))
    caplog.set_level("INFO", logger="prefixtrace.scheduler")
    running = []
    for ids in prompts:
        running.append(submit(engine, ids, SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)))
        time.sleep(0.05)
    results = [(seq, wait(events)) for seq, events in running]
    stats = dict(engine.stats)
    engine.shutdown()
    assert [done.finish_reason for _, (_, done) in results] == ["length"] * 3
    assert stats["aborts"] == 0
    assert stats["pauses"] + stats["parks"] >= 1 and stats["resumes"] == stats["pauses"] + stats["parks"]
    for (seq, _), reference in zip(results, solo):
        assert seq.output_ids == reference
    log = caplog.text
    assert "paused request" in log or "parked prefill" in log
    assert "resumed request" in log


def test_never_fits_is_rejected_with_the_numbers_and_a_fits_later_request_waits():
    engine = engine_with(prefill_step_size=16)
    mm = engine.memory
    small = MemoryModel(mm.weights_bytes, mm.kv_bytes_per_token, mm.transient_bytes,
                        mm.weights_bytes + mm.transient_bytes + 300 * mm.kv_bytes_per_token, mm.context_length)
    with pytest.raises(ContextExceedsCapacity) as info:
        small.fit(200, 200)
    details = info.value.details
    for key in ("weights_bytes", "kv_bytes_per_token", "prompt_tokens", "max_tokens", "transient_bytes",
                "capacity_bytes", "max_context_tokens"):
        assert isinstance(details[key], int), key
    assert details["retryable"] is False and details["max_context_tokens"] == 300
    small.fit(100, 200)  # fits alone: never rejected
    engine.shutdown()


def test_fit_clamps_a_max_tokens_past_the_room_after_the_prompt_or_refuses_a_prompt_with_none():
    small = MemoryModel(weights_bytes=0, kv_bytes_per_token=1, transient_bytes=0, ceiling_bytes=300, context_length=4096)
    assert small.fit(200, 50, clamp=True) == 50  # fits: as asked
    assert small.fit(200, 200, clamp=True) == 100  # lowered to the room left
    assert small.fit(200, None, clamp=True) is None  # unset: the scheduler caps it
    with pytest.raises(ContextExceedsCapacity) as info:
        small.fit(200, 200)  # no clamp: refused with the numbers
    assert info.value.details["max_tokens"] == 200
    with pytest.raises(ContextExceedsCapacity, match=r"the prompt \(300 tokens\) cannot fit"):
        small.fit(300, 5, clamp=True)


def test_kv_estimate_matches_measured_memory():
    """The model's KV bytes per token against MLX's counters: within 10% plus one allocation step."""
    from mlx_lm.models.cache import make_prompt_cache

    engine = engine_with()
    model, mm = engine.model, engine.memory
    engine.shutdown()
    tokens = 3000
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    cache = make_prompt_cache(model)
    for start in range(0, tokens, 500):
        model(mx.array([list(range(10, 510))]), cache=cache)
        mx.eval([c.state for c in cache])
    mx.clear_cache()
    measured = mx.get_active_memory() - before
    estimate = mm.kv_bytes_per_token * tokens
    step_slack = mm.kv_bytes_per_token * 256  # mlx-lm grows the cache 256 tokens at a time
    assert abs(measured - estimate) <= 0.10 * estimate + step_slack, (measured, estimate)


@pytest.mark.parametrize("cache_bytes", [64 << 20, 0], ids=["pinned-in-prefix-cache", "spilled"])
def test_parked_prefill_resumes_from_what_it_computed(cache_bytes, caplog):
    engine = engine_with(prefill_step_size=16, cache_bytes=cache_bytes)
    ids = prompt(engine, 30, "park")
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref, ref_events = submit(engine, ids, params)
    wait(ref_events)
    engine.shutdown()

    engine = engine_with(prefill_step_size=16, cache_bytes=cache_bytes)
    caplog.set_level("INFO", logger="prefixtrace.scheduler")
    events: queue.Queue = queue.Queue()
    seq = Sequence(list(ids), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), events.put)
    forced_pauses(engine).add(seq, park_at=64)
    engine.submit(seq)
    _, done = wait(events)
    stats = dict(engine.stats)
    engine.shutdown()
    assert stats["parks"] == 1 and stats["resumes"] == 1
    assert seq.output_ids == ref.output_ids
    assert ("pinned in the prefix cache" if cache_bytes else "spilled") in caplog.text

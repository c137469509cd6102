"""The engine on the tiny fixture model: prefix reuse is exact and changes no output."""

from __future__ import annotations

import queue

import pytest

from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.sequence import Failed, Finished, Sequence, TextDelta
from tests.conftest import TINY_MODEL

SYSTEM = "You are a helpful assistant. Read the file, run the tests, fix the bug."


def run(engine: Engine, messages, *, max_tokens=24, temperature=0.0, seed=None, cancel_after=None):
    prompt = engine.render(messages).token_ids
    events: queue.Queue = queue.Queue()
    seq = Sequence(prompt, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed), events.put)
    engine.submit(seq)
    text = []
    while True:
        event = events.get(timeout=60)
        if isinstance(event, TextDelta):
            text.append(event.text)
            if cancel_after is not None and len(text) >= cancel_after:
                seq.cancel()
        elif isinstance(event, Failed):
            raise event.error
        elif isinstance(event, Finished):
            return seq, event, "".join(text)


def fresh_engine() -> Engine:
    engine = Engine(TINY_MODEL, dtype="float32").start()
    engine.wait_ready(60)
    return engine


def conversation(first_reply: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "def main(): print('hello')"},
        {"role": "assistant", "content": first_reply},
        {"role": "user", "content": "Now explain what changed in the file."},
    ]


def test_greedy_reply_is_identical_cold_and_from_cached_prefix():
    warm = fresh_engine()
    _, first, reply = run(warm, conversation("")[:2])
    assert first.cached_tokens == 0
    seq_warm, second, text_warm = run(warm, conversation(reply), max_tokens=40)
    assert second.cached_tokens >= first.prompt_tokens - 3  # all but the generation prompt

    cold = fresh_engine()
    seq_cold, cold_done, text_cold = run(cold, conversation(reply), max_tokens=40)
    assert cold_done.cached_tokens == 0
    assert seq_warm.output_ids == seq_cold.output_ids
    assert text_warm == text_cold
    assert len(set(seq_cold.output_ids)) > 3  # the fixture model's output is not degenerate
    warm.shutdown()
    cold.shutdown()


def test_cached_tokens_is_the_exact_common_prefix(tiny_engine):
    seq1, _, reply = run(tiny_engine, conversation("")[:2], max_tokens=8)
    seq2, done, _ = run(tiny_engine, conversation(reply))
    common = 0
    for a, b in zip(seq1.all_ids, seq2.prompt_ids):
        if a != b:
            break
        common += 1
    assert done.cached_tokens == min(common, len(seq2.prompt_ids) - 1)


def test_same_prompt_twice_reuses_all_but_one_token(tiny_engine):
    msgs = conversation("")[:2]
    seq1, first, _ = run(tiny_engine, msgs)
    seq2, again, _ = run(tiny_engine, msgs)
    assert again.cached_tokens == again.prompt_tokens - 1
    assert seq1.output_ids == seq2.output_ids


def test_seeded_sampling_is_reproducible(tiny_engine):
    msgs = conversation("")[:2]
    a, _, _ = run(tiny_engine, msgs, temperature=1.0, seed=7)
    b, _, _ = run(tiny_engine, msgs, temperature=1.0, seed=7)
    c, _, _ = run(tiny_engine, msgs, temperature=1.0, seed=8)
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids


def test_cancel_stops_generation_and_keeps_the_computed_prefix(tiny_engine):
    msgs = conversation("")[:2]
    seq, done, _ = run(tiny_engine, msgs, max_tokens=5000, cancel_after=3)
    assert done.finish_reason == "cancelled"
    assert done.completion_tokens < 100
    # what was computed, prompt and partial output, serves the next request
    _, again, _ = run(tiny_engine, msgs)
    assert again.cached_tokens == again.prompt_tokens - 1


def test_prompt_longer_than_the_context_is_rejected_with_numbers(tiny_engine):
    from prefixtrace.common.errors import ContextExceedsCapacity

    with pytest.raises(ContextExceedsCapacity) as info:
        tiny_engine.fit(tiny_engine.context_length, 10)
    assert info.value.details["max_context_tokens"] == tiny_engine.context_length
    assert info.value.details["retryable"] is False


@pytest.mark.parametrize("together", [False, True], ids=["alone", "wave"])
def test_a_step_failing_between_prefill_and_decode_fails_the_request_instead_of_hanging(tiny_engine, together):
    """The step takes a finished prefill out of `prefill` (or pops a wave's companions out of
    `waiting`) before the rows join the decode batch; an exception in between used to leave
    those sequences in no list `fail_all` walks, and their requests waited forever."""
    scheduler = tiny_engine.scheduler
    join = scheduler._join

    def broken_join(*args, **kwargs):
        scheduler._join = join  # fail once; the engine keeps serving afterwards
        raise RuntimeError("injected failure joining the decode batch")

    scheduler._join = broken_join
    events = [queue.Queue() for _ in range(3 if together else 1)]
    seqs = [Sequence(list(range(10 + i, 30 + i)), SamplingParams(temperature=0.0, max_tokens=4), q.put)
            for i, q in enumerate(events)]
    tiny_engine.submit_all(seqs) if together else tiny_engine.submit(seqs[0])
    for q in events:
        event = q.get(timeout=30)  # before the fix: queue.Empty after 30 s
        while isinstance(event, TextDelta):
            event = q.get(timeout=30)
        assert isinstance(event, Failed) and "injected failure" in str(event.error)
    after = queue.Queue()
    tiny_engine.submit(Sequence(list(range(40, 60)), SamplingParams(temperature=0.0, max_tokens=3), after.put))
    event = after.get(timeout=30)
    while isinstance(event, TextDelta):
        event = after.get(timeout=30)
    assert isinstance(event, Finished) and event.completion_tokens == 3

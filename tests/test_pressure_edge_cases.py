"""Edge cases of pause / resume / park, cancellation, spill failures and the capacity numbers.

Real engine on the tiny model in float32; pauses and parks are forced with the `pause_at` /
`park_at` seam (testsupport/forced_pauses.py) or a small memory ceiling. No absolute time bounds: timeouts only catch hangs.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading

import pytest

from engine.engine import Engine
from engine.memory import MemoryModel
from engine.sampling import SamplingParams
from engine.sequence import Failed, Finished, Sequence, TextDelta
from tests.conftest import TINY_MODEL
from testsupport.forced_pauses import forced_pauses
from tests.test_memory_pressure import prompt, wait

GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=0.9, seed=11)


@pytest.fixture(scope="module")
def engine():
    engine = Engine(TINY_MODEL, dtype="float32", prefill_step_size=16).start()
    engine.wait_ready(60)
    yield engine
    engine.shutdown()


def run(engine: Engine, ids, pause_at=(), park_at=None, cancel_when=None, **params):
    """Submit one sequence and wait for its end: (seq, text, final event)."""
    events: queue.Queue = queue.Queue()
    seq = None

    def emit(event):
        events.put(event)
        if cancel_when is not None and cancel_when(seq, event):
            seq.cancel()

    seq = Sequence(list(ids), SamplingParams(**params), emit, record_logprobs=True)
    forced_pauses(engine).add(seq, pause_at=pause_at, park_at=park_at)
    engine.submit(seq)
    return seq, events


@contextlib.contextmanager
def own_engine(**kw):
    """A fresh engine of this test's own (its cache budget matters), shut down afterwards."""
    engine = Engine(TINY_MODEL, dtype="float32", prefill_step_size=16, **kw).start()
    engine.wait_ready(60)
    try:
        yield engine
    finally:
        engine.shutdown()


@contextlib.contextmanager
def damaged_spills(engine: Engine, damage):
    """While inside: every spill file the engine writes is rewritten as `damage(its bytes)`."""
    store = engine.scheduler.spill
    spill = store.spill

    def write(key, cache):
        path = spill(key, cache)
        path.write_bytes(damage(path.read_bytes()))
        return path

    store.spill = write
    try:
        yield
    finally:
        store.spill = spill


def only_the_paused_row_fails(engine: Engine, ids, other_ids, ref: Sequence) -> None:
    """`ids` pauses beside a bystander decoding `other_ids`: its spill fails, it ends with an
    error naming the spill, and the bystander still produces `ref`'s tokens."""
    other, other_events = run(engine, other_ids, max_tokens=60, ignore_eos=True, **GREEDY)
    seq, events = run(engine, ids, pause_at=(5,), max_tokens=60, ignore_eos=True, **GREEDY)
    _, done = wait(events)
    assert isinstance(done, Failed) and "spill" in str(done.error).lower()
    _, other_done = wait(other_events)
    assert isinstance(other_done, Finished) and other.output_ids == ref.output_ids


def solo_and_paused(engine, ids, pause_at, **params):
    ref, ref_events = run(engine, ids, **params)
    ref_text, ref_done = wait(ref_events)
    seq, events = run(engine, ids, pause_at=pause_at, **params)
    text, done = wait(events)
    return (ref, ref_text, ref_done), (seq, text, done)


def spill_files(engine):
    return sorted(p.name for p in engine.scheduler.spill.dir.iterdir())


# --- identity -------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("pause_at", [(1,), (1, 3, 5, 7), (38,)], ids=["first-token", "repeated", "last-but-one"])
def test_paused_output_is_token_identical(engine, sampling, pause_at):
    ids = prompt(engine, 8, "identity")
    before = dict(engine.stats)
    # max_tokens 40: a pause at 38 emits token 39 and resumes with one token left to make.
    (ref, ref_text, ref_done), (seq, text, done) = solo_and_paused(
        engine, ids, pause_at, max_tokens=40, ignore_eos=True, **sampling)
    assert isinstance(done, Finished) and done.finish_reason == ref_done.finish_reason == "length"
    assert seq.output_ids == ref.output_ids and len(seq.output_ids) == 40
    assert seq.token_logprobs == ref.token_logprobs
    assert text == ref_text
    assert done.completion_tokens == 40
    # Each pause emits the token sampled ahead, and the next decode step makes the one after it,
    # so offsets two apart are each reached.
    assert seq.num_pauses == len(pause_at)
    assert engine.stats["resumes"] - before["resumes"] == len(pause_at)
    assert spill_files(engine) == []


def test_pause_with_one_token_left_finishes_without_spilling(engine):
    ids = prompt(engine, 8, "edge")
    before = dict(engine.stats)
    (ref, ref_text, _), (seq, text, done) = solo_and_paused(engine, ids, (39,), max_tokens=40, ignore_eos=True,
                                                            **GREEDY)
    assert done.finish_reason == "length" and seq.output_ids == ref.output_ids and text == ref_text
    assert engine.stats["pauses"] == before["pauses"] and spill_files(engine) == []


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_stop_string_straddling_a_pause(engine, sampling):
    ids = prompt(engine, 8, "stop")
    ref, ref_events = run(engine, ids, max_tokens=60, ignore_eos=True, **sampling)
    full_text, _ = wait(ref_events)
    # A stop string made of the text of tokens 19..21, so it spans the pause after token 20.
    tok = engine.tokenizer
    head = tok.decode(ref.output_ids[:19])
    span = tok.decode(ref.output_ids[:22])[len(head):]
    assert full_text.startswith(head) and span.strip()
    stop = [span]
    base, base_events = run(engine, ids, max_tokens=60, ignore_eos=True, stop=stop, **sampling)
    base_text, base_done = wait(base_events)
    seq, events = run(engine, ids, pause_at=(20,), max_tokens=60, ignore_eos=True, stop=stop, **sampling)
    text, done = wait(events)
    assert base_done.finish_reason == "stop"
    assert seq.num_pauses == 1
    assert (text, done.finish_reason, done.completion_tokens) == (base_text, "stop", base_done.completion_tokens)
    assert seq.output_ids == base.output_ids
    assert stop[0] not in text


# --- cancellation ---------------------------------------------------------------------------


def test_cancelled_paused_row_ends_and_its_spill_file_goes(engine):
    ids = prompt(engine, 8, "cancel")
    before = dict(engine.stats)
    # Cancelled from its own emit callback at the pause: the pending token is emitted, then the KV
    # is spilled; the next step must reap it instead of resuming it.
    seq, events = run(engine, ids, pause_at=(5,), max_tokens=200, ignore_eos=True,
                      cancel_when=lambda s, e: isinstance(e, TextDelta) and len(s.output_ids) == 6, **GREEDY)
    _, done = wait(events)
    assert isinstance(done, Finished) and done.finish_reason == "cancelled"
    assert seq.num_pauses == 1 and done.completion_tokens == 6
    assert engine.stats["cancelled"] - before["cancelled"] == 1
    assert engine.stats["resumes"] == before["resumes"]
    assert spill_files(engine) == []


@pytest.mark.parametrize("cache_bytes", [64 << 20, 0], ids=["pinned", "spilled"])
def test_cancelled_parked_prefill_releases_its_pins_and_file(cache_bytes):
    with own_engine(cache_bytes=cache_bytes) as engine:
        sched = engine.scheduler
        park = sched._park_prefill

        def park_then_cancel():
            seq = sched.prefill.seq
            park()
            seq.cancel()

        sched._park_prefill = park_then_cancel
        ids = prompt(engine, 30, "park")
        seq, events = run(engine, ids, park_at=48, max_tokens=10, **GREEDY)
        _, done = wait(events)
        assert isinstance(done, Finished) and done.finish_reason == "cancelled"
        assert engine.stats["parks"] == 1 and engine.stats["resumes"] == 0 and engine.stats["cancelled"] == 1
        assert spill_files(engine) == []
        assert not engine.prefix_cache.memory._pins
        # The engine goes on serving.
        seq, events = run(engine, ids, max_tokens=4, **GREEDY)
        assert wait(events)[1].finish_reason == "length"


def _pressure_engine(probe: Engine, long_ids, max_tokens: int, factor: float) -> Engine:
    mm = probe.memory
    one = MemoryModel.for_model(probe.model, context_length=mm.context_length, prefill_chunk=16)
    final = one.need_bytes(len(long_ids) + max_tokens)
    engine = Engine(TINY_MODEL, dtype="float32", prefill_step_size=16,
                    memory_ceiling_bytes=one.weights_bytes + int(final * factor)).start()
    engine.wait_ready(60)
    return engine


def test_cancelled_waiting_request_ends_before_the_running_one(engine):
    ids_a = prompt(engine, 40, "alpha")
    ids_b = prompt(engine, 40, "beta")
    small = _pressure_engine(engine, ids_a, 300, 1.05)  # holds one of them, never both
    try:
        order: list = []
        lock = threading.Lock()

        def tagged(tag):
            def emit(event):
                with lock:
                    order.append((tag, event))
            return emit

        a = Sequence(list(ids_a), SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True), tagged("a"))
        small.submit(a)
        deadline = threading.Event()
        while not any(t == "a" and isinstance(e, TextDelta) for t, e in list(order)):
            deadline.wait(0.01)
        b = Sequence(list(ids_b), SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True), tagged("b"))
        b.cancel()
        small.submit(b)
        for _ in range(6000):
            with lock:
                ends = [t for t, e in order if isinstance(e, (Finished, Failed))]
            if len(ends) == 2:
                break
            deadline.wait(0.01)
        assert ends[0] == "b", "a cancelled waiting request waited for the running one to finish"
        b_end = next(e for t, e in order if t == "b")
        assert isinstance(b_end, Finished) and b_end.finish_reason == "cancelled"
        assert small.stats["cancelled"] == 1
    finally:
        small.shutdown()


# --- two requests that each fit alone, not together ----------------------------------------


def test_two_large_requests_that_fit_only_alone_both_finish(engine):
    ids_a = prompt(engine, 40, "alpha")
    ids_b = prompt(engine, 41, "beta")
    refs = []
    for ids in (ids_a, ids_b):
        seq, events = run(engine, ids, max_tokens=150, ignore_eos=True, **GREEDY)
        wait(events)
        refs.append(seq.output_ids)
    small = _pressure_engine(engine, ids_b, 150, 1.1)
    try:
        a, a_events = run(small, ids_a, max_tokens=150, ignore_eos=True, **GREEDY)
        b, b_events = run(small, ids_b, max_tokens=150, ignore_eos=True, **GREEDY)
        done = [wait(a_events)[1], wait(b_events)[1]]
        assert [d.finish_reason for d in done] == ["length", "length"]
        assert [a.output_ids, b.output_ids] == refs
        assert small.stats["aborts"] == 0
        assert spill_files(small) == []
    finally:
        small.shutdown()


# --- spill files ----------------------------------------------------------------------------


# A paused row whose blocks the prefix cache can hold writes no file (next section); these
# engines have no memory tier, so their rows spill.


@pytest.fixture(scope="module")
def spilling():
    engine = Engine(TINY_MODEL, dtype="float32", prefill_step_size=16, cache_bytes=0).start()
    engine.wait_ready(60)
    yield engine
    engine.shutdown()


def test_spill_directory_removed_mid_run_is_recreated(spilling, tmp_path):
    engine = spilling
    ids = prompt(engine, 8, "gone")
    ref, ref_events = run(engine, ids, max_tokens=30, ignore_eos=True, **GREEDY)
    wait(ref_events)
    old = engine.scheduler.spill.dir
    engine.scheduler.spill.dir = tmp_path / "spill"  # never created: as if removed while running
    try:
        seq, events = run(engine, ids, pause_at=(5,), max_tokens=30, ignore_eos=True, **GREEDY)
        _, done = wait(events)
        assert isinstance(done, Finished) and done.finish_reason == "length"
        assert seq.output_ids == ref.output_ids and seq.num_pauses == 1
    finally:
        engine.scheduler.spill.dir = old


def test_unwritable_spill_directory_fails_only_that_request(spilling, tmp_path):
    engine = spilling
    ids = prompt(engine, 8, "ro")
    other_ids = prompt(engine, 9, "other")
    ref, ref_events = run(engine, other_ids, max_tokens=60, ignore_eos=True, **GREEDY)
    wait(ref_events)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    old = engine.scheduler.spill.dir
    engine.scheduler.spill.dir = blocker / "spill"  # cannot be created, even by root
    try:
        only_the_paused_row_fails(engine, ids, other_ids, ref)
    finally:
        engine.scheduler.spill.dir = old
    seq, events = run(engine, ids, max_tokens=4, **GREEDY)
    assert wait(events)[1].finish_reason == "length"


@pytest.mark.parametrize("kind", ["truncated", "garbage"])
def test_corrupt_spill_file_at_resume_fails_only_that_row(spilling, kind):
    engine = spilling
    ids = prompt(engine, 8, "corrupt")
    other_ids = prompt(engine, 9, "other")
    ref, ref_events = run(engine, other_ids, max_tokens=60, ignore_eos=True, **GREEDY)
    wait(ref_events)
    damage = (lambda data: data[: len(data) // 2]) if kind == "truncated" else (lambda data: b"\x07" * len(data))
    with damaged_spills(engine, damage):
        only_the_paused_row_fails(engine, ids, other_ids, ref)
    assert spill_files(engine) == []


def test_corrupt_spill_file_of_a_parked_prefill_recomputes(tmp_path):
    with own_engine(cache_bytes=0) as engine:  # parks spill
        ids = prompt(engine, 30, "park")
        ref, ref_events = run(engine, ids, max_tokens=20, ignore_eos=True, **GREEDY)
        wait(ref_events)
        with damaged_spills(engine, lambda data: data[:100]):
            seq, events = run(engine, ids, park_at=48, max_tokens=20, ignore_eos=True, **GREEDY)
            _, done = wait(events)
        assert isinstance(done, Finished) and seq.output_ids == ref.output_ids
        assert spill_files(engine) == []


# --- capacity numbers from another thread ---------------------------------------------------


def test_capacity_is_safe_to_read_while_rows_come_and_go(engine):
    ids = [prompt(engine, 3 + i, f"cap{i}") for i in range(6)]
    errors: list = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            try:
                engine.capacity()
            except Exception as exc:  # noqa: BLE001 - any error is the failure
                errors.append(exc)
                return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for _ in range(3):
            running = [run(engine, p, max_tokens=3 + i, ignore_eos=True, **GREEDY) for i, p in enumerate(ids)]
            for _, events in running:
                wait(events)
    finally:
        stop.set()
        poller.join(30)
        sys.setswitchinterval(interval)
    assert not errors, errors


# --- a failing step ---------------------------------------------------------------------------


@pytest.mark.parametrize("cache_bytes", [64 << 20, 0], ids=["pinned", "spilled"])
@pytest.mark.parametrize("where", ["row", "prefill"])
def test_a_failing_step_releases_what_paused_requests_hold(where, cache_bytes):
    with own_engine(cache_bytes=cache_bytes) as engine:
        sched = engine.scheduler
        resume = sched._resume

        def broken_resume():
            if sched.paused:
                sched._resume = resume
                raise RuntimeError("boom")
            resume()

        sched._resume = broken_resume
        ids = prompt(engine, 30, "fail")
        if where == "row":
            seq, events = run(engine, ids, pause_at=(5,), max_tokens=20, **GREEDY)
        else:
            seq, events = run(engine, ids, park_at=48, max_tokens=20, **GREEDY)
        _, done = wait(events)
        assert isinstance(done, Failed) and "boom" in str(done.error)
        assert spill_files(engine) == []
        assert not engine.prefix_cache.memory._pins
        seq, events = run(engine, ids, max_tokens=4, **GREEDY)
        assert wait(events)[1].finish_reason == "length"


def test_without_max_tokens_a_request_stops_where_memory_ends():
    """Admission checks one output token when max_tokens is unset; the row must then stop at what
    the memory ceiling holds (finish "length"), not grow towards default_max_tokens past it."""
    probe = Engine(TINY_MODEL, dtype="float32", prefill_step_size=16).start()
    probe.wait_ready(60)
    ids = prompt(probe, 6, "limits")
    kv, transient = probe.memory.kv_bytes_per_token, probe.memory.transient_bytes
    weights = probe.memory.weights_bytes
    probe.shutdown()
    room = len(ids) + 7  # tokens the ceiling holds
    ceiling = weights + transient + kv * room
    engine = Engine(TINY_MODEL, dtype="float32", prefill_step_size=16, memory_ceiling_bytes=ceiling).start()
    engine.wait_ready(60)
    try:
        assert engine.memory.max_context_tokens == room
        seq, events = run(engine, ids, ignore_eos=True, **GREEDY)
        _, end = wait(events)
        assert isinstance(end, Finished) and end.finish_reason == "length"
        assert end.completion_tokens == room - len(ids)
    finally:
        engine.shutdown()


# --- pauses through the prefix cache --------------------------------------------------------


def test_a_pause_copies_only_the_blocks_the_prefix_cache_lacks(monkeypatch):
    """A paused row's KV goes to the prefix cache as pinned blocks: the prompt's blocks were
    committed during its prefill, so the pause copies only the blocks (and tail) after them,
    writes no spill file, and the resumed output is token-identical. Before, the whole row
    was written to a spill file (the ~12 s stall extrapolated for a 100k-token row)."""
    import engine.prefix_cache as prefix_cache

    with own_engine(block_size=16) as engine:
        ids = prompt(engine, 30, "pinned")
        assert len(ids) > 5 * 16
        ref, ref_events = run(engine, ids, max_tokens=30, ignore_eos=True, **GREEDY)
        wait(ref_events)
        copies, real_cut = [], prefix_cache.cut
        monkeypatch.setattr(prefix_cache, "cut", lambda c, a, b, **kw: copies.append((a, b)) or real_cut(c, a, b, **kw))
        fresh = [t + 1 if t + 1 < engine.model.args.vocab_size else 1 for t in ids[:-4]] + ids[-4:]  # no hit
        ref2, ref2_events = run(engine, fresh, max_tokens=30, ignore_eos=True, **GREEDY)
        wait(ref2_events)
        copies.clear()
        written = engine.scheduler.spill.bytes_written
        seq, events = run(engine, fresh, pause_at=(5,), max_tokens=30, ignore_eos=True, **GREEDY)
        _, done = wait(events)
        assert isinstance(done, Finished) and seq.num_pauses == 1 and seq.output_ids == ref2.output_ids
        assert engine.scheduler.spill.bytes_written == written and spill_files(engine) == []
        prompt_blocks = (len(fresh) - 1) // 16 * 16
        pause_copies = [(a, b) for a, b in copies if b <= len(fresh) + 6]  # the final store copies later ones
        assert pause_copies and all(a >= prompt_blocks for a, _ in pause_copies)

"""TurboQuant blocks in the paged prefix cache: bit-exact restore, in memory and from disk."""

from __future__ import annotations

import queue

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from engine.cache_blocks import TQLayer, cut, from_numpy, join, to_numpy
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.sequence import Failed, Finished, Sequence
from engine.tq_cache import TurboQuantKVCache
from engine.tq_config import TQConfig, append_suffix, dense_copy
from tests.conftest import TINY_MODEL
from tests.test_cache_engine import LONG

PROMPT_LEN = 134  # 133 cached positions: two 64-token groups and a 5-token dense tail


def tq_engine(**kw) -> Engine:
    kw.setdefault("block_size", 16)
    e = Engine(TINY_MODEL, dtype="float32", kv_quant="turboquant", **kw).start()
    e.wait_ready(60)
    return e


def prompt_ids(e: Engine) -> list[int]:
    ids = e.render(LONG).token_ids
    assert len(ids) > PROMPT_LEN
    return list(ids[:PROMPT_LEN])


def generate(e: Engine, ids: list[int], max_tokens: int = 8) -> tuple[list[int], Finished]:
    events: queue.Queue = queue.Queue()
    seq = Sequence(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), events.put)
    e.submit(seq)
    while True:
        event = events.get(timeout=60)
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Finished):
            return seq.output_ids, event


def host_state(cache: list) -> list:
    """Host copies of every layer's state (TurboQuant: norms, codes, dense tail)."""
    return [[np.array(a) for a in (layer.state[:2] if not isinstance(layer, TurboQuantKVCache) else layer.state)]
            for layer in cache]


def spy(e: Engine) -> tuple[list, list]:
    """Record (on the engine thread) the caches handed to `store` and returned by `lookup`."""
    stored, restored = [], []
    cache = e.prefix_cache
    real_store, real_lookup = cache.store, cache.lookup

    def store(tokens, kv):
        stored.append(host_state(kv))
        real_store(tokens, kv)

    def lookup(tokens, **kw):
        hit = real_lookup(tokens, **kw)
        restored.append((hit.num_cached, host_state(hit.cache), [type(c) for c in hit.cache]))
        return hit

    cache.store, cache.lookup = store, lookup
    return stored, restored


def test_turboquant_engine_restores_its_own_codes_bit_for_bit():
    e = tq_engine()
    try:
        stored, restored = spy(e)
        ids = prompt_ids(e)
        first, done = generate(e, ids)
        assert done.cached_tokens == 0 and stored
        again, warm = generate(e, ids)
        assert warm.cached_tokens == PROMPT_LEN - 1
        num_cached, state, types = restored[-1]
        assert num_cached == PROMPT_LEN - 1
        assert types[0] is TurboQuantKVCache and types[-1] is not TurboQuantKVCache  # the last layer stays dense
        n, tail_start = num_cached, num_cached - num_cached % 64
        for got, want, kind in zip(state, stored[0], types):
            if kind is TurboQuantKVCache:
                for g, w in zip(got[:4], want[:4]):  # norms and codes of K and V
                    assert g.shape[2] == n and np.array_equal(g, w[:, :, :n])
                for g, w in zip(got[4:], want[4:]):  # the dense tail, as the first run held it
                    assert g.shape[2] == n - tail_start and np.array_equal(g, w[:, :, : n - tail_start])
            else:
                for g, w in zip(got, want):
                    assert np.array_equal(g[:, :, :n], w[:, :, :n])
        assert again == first  # greedy continuation from the restored prefix = the first run's
        # A second turn that extends the first reuses it too.
        _, turn = generate(e, ids + first + ids[:20])
        assert turn.cached_tokens >= PROMPT_LEN - 1
    finally:
        e.shutdown()


def test_turboquant_blocks_survive_a_restart_and_stay_apart_from_dense(tmp_path):
    first_engine = tq_engine(cache_dir=tmp_path)
    ids = prompt_ids(first_engine)
    first, done = generate(first_engine, ids)
    first_engine.shutdown()  # flushes the disk writer

    second = tq_engine(cache_dir=tmp_path)
    try:
        again, warm = generate(second, ids)
        assert warm.cached_tokens == PROMPT_LEN - 1
        assert second.prefix_cache.stats["disk_blocks_read"] > 0
        assert second.prefix_cache.cache_format.startswith("turboquant/4/0/64/")
        assert again == first
    finally:
        second.shutdown()

    dense = Engine(TINY_MODEL, dtype="float32", block_size=16, cache_dir=tmp_path).start()
    dense.wait_ready(60)
    try:
        _, cold = generate(dense, ids)
        assert cold.cached_tokens == 0  # lossy KV never serves a dense engine
    finally:
        dense.shutdown()


def _filled(n: int, seed: int = 0, group: int = 64) -> TurboQuantKVCache:
    c = TurboQuantKVCache(4, 0, group)
    k = mx.random.normal((1, 2, n, 16), key=mx.random.key(seed))
    c.update_and_fetch(k, -k)
    return c


def test_turboquant_block_round_trips_through_host_copies():
    c = _filled(150)
    blocks = [cut([c], s, min(s + 64, 150)) for s in range(0, 150, 64)]
    assert blocks[-1][0].dense_k.shape[2] == 150 - 128 and blocks[0][0].dense_k is None
    back = [from_numpy(to_numpy(b)) for b in blocks]
    assert all(isinstance(b[0], TQLayer) for b in back)
    joined = join([(b, b[0].num_positions) for b in back], tq=TQConfig(group=64), dims=[(16, 16, mx.float32)])[0]
    assert joined.offset == 150
    for got, want in zip(joined.state, c.state):
        assert np.array_equal(np.array(got), np.array(want))


def test_dense_suffix_prefill_keeps_prefix_codes_bit_for_bit():
    c = _filled(100)
    before = [np.array(a) for a in c.state[:4]]
    suffix = mx.random.normal((1, 2, 300, 16), key=mx.random.key(1))
    dense = dense_copy([c], 300)[0]
    assert dense.offset == 100
    dense.update_and_fetch(suffix[:, :, :150], -suffix[:, :, :150])
    dense.update_and_fetch(suffix[:, :, 150:], -suffix[:, :, 150:])
    out = append_suffix([c], [dense])[0]
    assert out is c and out.offset == 400 and out.tail_k.shape[2] == 400 - 384
    for got, want in zip(out.state[:4], before):
        assert np.array_equal(np.array(got)[:, :, :100], want)
    # The suffix's codes are the codec's encoding of its dense K/V.
    norms, codes = c.codec(16).encode(suffix)
    assert np.array_equal(np.array(out.state[1])[:, :, 100:], np.array(codes))


def test_restored_prefix_prefill_runs_dense_and_reuses_prefix_codes_bit_for_bit(caplog):
    e = tq_engine(prefill_step_size=32)
    try:
        stored, restored = spy(e)
        ids = prompt_ids(e)
        generate(e, ids, max_tokens=2)
        with caplog.at_level("INFO", logger="prefixtrace.scheduler"):
            out, done = generate(e, ids + ids, max_tokens=4)  # a 134-token suffix: five 32-token chunks
        assert len(out) == 4 and done.cached_tokens >= PROMPT_LEN - 1
        assert any("prefills on a dense copy" in r.getMessage() for r in caplog.records)
        n, before, types = restored[-1]
        after = stored[-1]
        for got, want, kind in zip(after, before, types):
            if kind is TurboQuantKVCache:
                assert got[1].shape[2] > n
                for g, w in zip(got[:4], want[:4]):
                    assert np.array_equal(g[:, :, :n], w)
    finally:
        e.shutdown()


# --- attention in the rotated basis (engine.tq_cache.install_attention_hook) -----------


def _tq_filled(cache, chunks, H=2, D=64, seed=3):
    mx.random.seed(seed)
    for n in chunks:
        cache.update_and_fetch(mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D)))
    return cache


def test_rotated_attention_equals_attention_over_the_decoded_cache():
    cache = _tq_filled(TurboQuantKVCache(kv_bits=4, group=16), [70, 9])  # codes and a dense tail
    for n in (1, 5):  # a decode step, and a chunk with a causal mask
        keys, values = mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64))
        dense_k, dense_v = cache.update_and_fetch(keys, values)
        q = mx.random.normal((1, 4, n, 64))  # GQA: 4 query heads over 2 KV heads
        mask = "causal" if n > 1 else None
        ref = mx.fast.scaled_dot_product_attention(q, dense_k, dense_v, scale=0.125, mask=mask)
        got = cache.attend(q, 0.125, mask)
        assert mx.abs(got - ref).max().item() < 1e-4


def test_rotated_attention_over_left_padded_rows():
    rows = [_tq_filled(TurboQuantKVCache(kv_bits=3, group=16), chunks, seed=i)
            for i, chunks in enumerate([[40], [7, 30, 1], [5]])]
    batch = TurboQuantKVCache.merge(rows)
    mask = batch.make_mask(1)  # as a model asks for it: before the layers add the new token
    keys, values = mx.random.normal((3, 2, 1, 64)), mx.random.normal((3, 2, 1, 64))
    dense_k, dense_v = batch.update_and_fetch(keys, values)
    q = mx.random.normal((3, 2, 1, 64))
    ref = mx.fast.scaled_dot_product_attention(q, dense_k, dense_v, scale=0.125, mask=mask)
    assert mx.abs(batch.attend(q, 0.125, mask) - ref).max().item() < 1e-4


def test_hook_routes_only_turboquant_caches():
    from mlx_lm.models import llama

    from engine.model_files import load_model_dir
    from engine.tq_config import make_tq_cache
    from engine.attention_hook import install_attention_hook
    from tests.conftest import TINY_MODEL

    model, _, _ = load_model_dir(TINY_MODEL, "float32")
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38] * 8])
    dense_before = model(tokens, cache=[KVCache() for _ in model.layers])
    install_attention_hook(model)
    assert getattr(llama.scaled_dot_product_attention, "prefixtrace_tq_hook", False)
    assert install_attention_hook(model) == 0  # idempotent
    assert mx.array_equal(model(tokens, cache=[KVCache() for _ in model.layers]), dense_before)
    # A TurboQuant cache gives the same logits through the hook as through its decoded K/V.
    hooked = model(tokens, cache=make_tq_cache(model, bits=4, group=16))
    original = llama.scaled_dot_product_attention
    try:
        from mlx_lm.models.base import scaled_dot_product_attention as plain
        llama.scaled_dot_product_attention = plain
        unhooked = model(tokens, cache=_tq_layers(model))
    finally:
        llama.scaled_dot_product_attention = original
    assert mx.abs(hooked - unhooked).max().item() < 1e-3


def _tq_layers(model):
    return [KVCache() if i == len(model.layers) - 1 else TurboQuantKVCache(4, 0, 16) for i in range(len(model.layers))]


# --- cold prefill on dense caches, quantised once (engine.dense_prefill.plan, pos 0) ---------


def test_cold_prefill_runs_dense_and_equals_quantising_a_dense_prefill(caplog):
    """A TurboQuant engine's multi-chunk cold prefill leaves exactly the codes
    `from_dense` makes of a dense engine's prefill of the same prompt in the same chunks
    (before: every chunk after the first attended over decoded codes, so the K/V of
    layers above the first, and their codes, differed)."""
    tq = tq_engine(prefill_step_size=32)  # 133 prompt positions: five chunks
    try:
        stored, _ = spy(tq)
        ids = prompt_ids(tq)
        with caplog.at_level("INFO", logger="prefixtrace.scheduler"):
            generate(tq, ids, max_tokens=1)
        assert any("cold prefill of 133 tokens on dense caches" in r.getMessage() for r in caplog.records)
        got = stored[-1]
    finally:
        tq.shutdown()
    dense = Engine(TINY_MODEL, dtype="float32", block_size=16, prefill_step_size=32).start()
    dense.wait_ready(60)
    try:
        dense_stored, _ = spy(dense)
        generate(dense, ids, max_tokens=1)
        want_layers = dense_stored[-1]
    finally:
        dense.shutdown()
    n = PROMPT_LEN - 1  # the last prompt token is fed by the decode step, on TurboQuant caches
    checked = 0
    for layer, (g, w) in enumerate(zip(got, want_layers)):
        if len(g) == 2:  # the dense last layer: the same K/V
            assert all(np.array_equal(a[:, :, :n], b[:, :, :n]) for a, b in zip(g, w))
            continue
        kv = KVCache()
        kv.state = (mx.array(w[0][:, :, :n]), mx.array(w[1][:, :, :n]), n)
        want = [np.array(a) for a in TurboQuantKVCache.from_dense(kv, kv_bits=4, seed=0, group=64).state]
        for a, b in zip(g[:4], want[:4]):  # norms and codes of K and V
            assert np.array_equal(a[:, :, :n], b)
        for a, b in zip(g[4:], want[4:]):  # the dense tail
            assert np.array_equal(a[:, :, : b.shape[2]], b)
        checked += 1
    assert checked == len(got) - 1


def test_cold_prefill_in_chunks_decodes_as_one_chunk_and_warm_turn_still_hits():
    """Chunking no longer changes a TurboQuant engine's output: a prompt prefilled in five
    chunks continues as one prefilled in a single chunk (which always saw its own tokens
    dense and quantised once); its blocks, committed quantised at the end, serve the warm
    turn, which continues the same way."""
    one = tq_engine(prefill_step_size=1024)
    try:
        ids = prompt_ids(one)
        want, _ = generate(one, ids, max_tokens=24)
    finally:
        one.shutdown()
    e = tq_engine(prefill_step_size=32)
    try:
        first, cold = generate(e, ids, max_tokens=24)
        assert cold.cached_tokens == 0 and first == want
        again, warm = generate(e, ids, max_tokens=24)
        assert warm.cached_tokens == PROMPT_LEN - 1 and again == first
    finally:
        e.shutdown()


def test_cold_dense_prefill_is_charged_at_dense_bytes():
    """The memory model charges a TurboQuant engine's prefill at dense bytes per token,
    which is what the dense caches of a cold prefill hold: the never-fits check and
    admission never promise a prompt that could not be prefilled dense."""
    e = tq_engine(prefill_step_size=32)
    seen = []
    sched = e.scheduler
    real = sched._prefill_chunk

    def chunk():
        job = sched.prefill
        real()
        if sched.prefill is job and job.final_cache is not None:
            held = sum(c.keys[:, :, : c.offset].nbytes + c.values[:, :, : c.offset].nbytes for c in job.cache)
            seen.append((held, job.pos * sched.memory.kv_bytes_per_token))

    sched._prefill_chunk = chunk
    try:
        generate(e, prompt_ids(e), max_tokens=1)
    finally:
        e.shutdown()
    assert len(seen) >= 3  # chunks run on dense caches
    assert all(held <= charged for held, charged in seen)
    assert seen[-1][0] == seen[-1][1]  # every layer dense while prefilling: exactly what is charged


def _ended(events: queue.Queue):
    while True:
        event = events.get(timeout=60)
        if isinstance(event, (Finished, Failed)):
            return event


def test_a_step_failing_between_chunks_keeps_what_the_cold_prefill_did(caplog):
    """A step that fails while a cold prefill runs on dense caches (here: another request's
    decode step, between two of its chunks) fails both requests, but the chunks already done
    go to the prefix cache quantised, as a cancel's would: the re-sent request resumes from
    them. Before, `fail_all` dropped them (nothing of a dense-chunk prefill is committed until
    its prompt is in)."""
    e = tq_engine(prefill_step_size=32)  # the long prompt: 133 positions, five chunks
    sched = e.scheduler
    real_decode = sched._decode
    failed_at = []

    def decode():
        job = sched.prefill
        if job is not None and job.final_cache is not None and job.pos >= 64 and not failed_at:
            failed_at.append(job.pos)
            sched._decode = real_decode  # once; the engine serves on afterwards
            raise RuntimeError("injected failure in another row's decode step")
        real_decode()

    try:
        ids = prompt_ids(e)
        short_events, long_events = queue.Queue(), queue.Queue()
        e.submit(Sequence(ids[-20:][::-1], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True),
                          short_events.put))
        short_events.get(timeout=60)  # decoding: the long prompt's chunks now run between its steps
        sched._decode = decode
        with caplog.at_level("INFO", logger="prefixtrace.scheduler"):
            e.submit(Sequence(ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), long_events.put))
            for events in (short_events, long_events):
                event = _ended(events)
                assert isinstance(event, Failed) and "injected failure" in str(event.error)
        assert failed_at and 64 <= failed_at[0] < PROMPT_LEN - 1
        assert any("prefilled tokens are kept" in r.getMessage() for r in caplog.records)
        again = queue.Queue()
        e.submit(Sequence(ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), again.put))
        event = _ended(again)
        assert isinstance(event, Finished) and event.completion_tokens == 4
        # Kept to a whole 64-token group at least (a TurboQuant hit is cut back to one).
        assert 64 <= event.cached_tokens <= failed_at[0]
    finally:
        e.shutdown()


def test_a_step_failing_inside_a_chunk_keeps_nothing_of_it():
    """A failure inside the chunk itself may leave part of it in some layers: nothing is kept,
    and the engine serves the re-sent request cold, with the output of a never-failed run."""
    e = tq_engine(prefill_step_size=32)
    try:
        ids = prompt_ids(e)
        want, _ = generate(e, ids, max_tokens=6)  # a fresh engine below: nothing of this is cached there
    finally:
        e.shutdown()
    e = tq_engine(prefill_step_size=32)
    admission = e.scheduler.admission  # runs the prefill chunks
    model = admission.model
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the third chunk, after two went in
            raise RuntimeError("injected failure inside a chunk")
        return model(*args, **kwargs)

    try:
        admission.model = broken
        events = queue.Queue()
        e.submit(Sequence(ids, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), events.put))
        event = _ended(events)
        assert isinstance(event, Failed) and "inside a chunk" in str(event.error)
        admission.model = model
        got, finished = generate(e, ids, max_tokens=6)
        assert finished.cached_tokens == 0 and got == want
    finally:
        e.shutdown()

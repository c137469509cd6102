"""Batched decode on the tiny model in float32: a row produces what it would alone."""

from __future__ import annotations

import queue

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.sequence import Failed, Finished, Sequence, TextDelta
from tests.conftest import TINY_MODEL

# Longest first: it is prefilled first and is still decoding when the short ones join.
PROMPTS = [
    [{"role": "system", "content": "Read the file, run the tests, fix the bug and explain what changed. " * 40},
     {"role": "user", "content": "Explain the todo list."}],
    [{"role": "system", "content": "You read files and fix bugs. " * 6}, {"role": "user", "content": "def main(): print('x')"}],
    [{"role": "user", "content": "hi"}],
]


def fresh_engine(**kwargs) -> Engine:
    engine = Engine(TINY_MODEL, dtype="float32", **kwargs).start()
    engine.wait_ready(60)
    return engine


def submit(engine: Engine, messages, params: SamplingParams):
    events: queue.Queue = queue.Queue()
    seq = Sequence(engine.render(messages).token_ids, params, events.put)
    engine.submit(seq)
    return seq, events


def wait(events: queue.Queue) -> tuple[str, Finished]:
    text = []
    while True:
        event = events.get(timeout=120)
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, Failed):
            raise event.error
        elif isinstance(event, Finished):
            return "".join(text), event


def run_alone(messages, params: SamplingParams) -> tuple[list[int], str]:
    engine = fresh_engine()
    seq, events = submit(engine, messages, params)
    text, _ = wait(events)
    engine.shutdown()
    return seq.output_ids, text


@pytest.mark.parametrize(
    "params",
    # Enough tokens that the long row is still decoding when the short ones join, however the machine is loaded.
    [SamplingParams(temperature=0.0, max_tokens=120), SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=120)],
    ids=["greedy", "seeded"],
)
@pytest.mark.slow
def test_rows_of_very_different_lengths_decode_as_they_would_alone(params):
    alone = [run_alone(p, params) for p in PROMPTS]
    engine = fresh_engine(prefill_step_size=64)
    running = [submit(engine, p, SamplingParams(**{f: getattr(params, f) for f in params.__slots__})) for p in PROMPTS]
    together = [(seq.output_ids, wait(events)[0]) for seq, events in running]
    assert engine.stats["peak_batch"] == 3
    assert engine.stats["waves"] == 0  # different lengths never share a prefill
    engine.shutdown()
    lengths = [len(seq.prompt_ids) for seq, _ in running]
    assert max(lengths) > 10 * min(lengths)
    for (ids_alone, text_alone), (ids_batched, text_batched) in zip(alone, together):
        assert ids_batched == ids_alone
        assert text_batched == text_alone


def test_short_row_attention_ignores_left_padding():
    """One attention layer over a left-padded batch equals each row computed alone."""
    from mlx_lm.utils import load

    model, tokenizer = load(str(TINY_MODEL))
    model.set_dtype(mx.float32)
    attn = model.model.layers[0].self_attn
    dim = model.args.hidden_size
    mx.random.seed(3)
    lengths = [3, 57, 400]
    singles = []
    for n in lengths:
        cache = KVCache()
        x = mx.random.normal((1, n, dim))
        attn(x, mask="causal", cache=cache)
        singles.append(cache)
    step = mx.random.normal((len(lengths), 1, dim))
    reference = [attn(step[i : i + 1], mask=None, cache=c) for i, c in enumerate(singles)]

    fresh = []  # the same prefixes again, for the batched cache
    mx.random.seed(3)
    for n in lengths:
        cache = KVCache()
        attn(mx.random.normal((1, n, dim)), mask="causal", cache=cache)
        fresh.append(cache)
    batch_cache = BatchKVCache.merge(fresh)
    mask = batch_cache.make_mask(1)
    batched = attn(step, mask=mask, cache=batch_cache)
    for i, ref in enumerate(reference):
        got = batched[i : i + 1]
        ratio = (mx.linalg.norm(got) / mx.linalg.norm(ref)).item()
        diff = mx.abs(got - ref).max().item()
        assert abs(ratio - 1.0) < 1e-4, (lengths[i], ratio)
        assert diff < 2e-3, (lengths[i], diff)


def test_batch_cache_skips_the_mask_only_when_no_row_is_padded():
    from engine.batch_cache import RowBatchKVCache

    def layer(n: int) -> KVCache:
        cache = KVCache()
        cache.update_and_fetch(mx.zeros((1, 2, n, 4)), mx.zeros((1, 2, n, 4)))
        return cache

    batch = RowBatchKVCache.merge([layer(5)])
    assert batch.make_mask(1) is None
    batch.extend(RowBatchKVCache.merge([layer(9)]))
    mask = batch.make_mask(1)
    assert mask is not None and mask.shape[-1] == 10  # 9 cached + the new token
    assert mask[0].sum().item() == 6 and mask[1].sum().item() == 10  # row 0 ignores its 4 padding slots
    batch.filter([1])
    assert batch.make_mask(1) is None


WAVE = [[{"role": "user", "content": f"Write a haiku about a {w} and its neighbours."}] for w in ("owl", "bee", "cow", "ant")]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
     SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True)],
    ids=["greedy", "seeded"],
)
def test_equal_length_prompts_arriving_together_prefill_as_one_wave(params):
    """Same-length prompts submitted together prefill in one forward pass, decode as
    an unpadded batch, and each still produces exactly what it produces alone."""
    engine = fresh_engine()
    lengths = {len(engine.render(m).token_ids) for m in WAVE}
    assert len(lengths) == 1, lengths  # one word apart, same token count
    engine.shutdown()
    alone = [run_alone(m, params) for m in WAVE]

    engine = fresh_engine()
    seqs, queues = [], []
    for messages in WAVE:
        q: queue.Queue = queue.Queue()
        seqs.append(Sequence(engine.render(messages).token_ids, SamplingParams(
            **{f: getattr(params, f) for f in params.__slots__}), q.put))
        queues.append(q)
    engine.submit_all(seqs)
    texts = [wait(q)[0] for q in queues]
    stats = dict(engine.stats)
    engine.shutdown()
    assert stats["waves"] == 1 and stats["peak_batch"] == 4
    for (ids_alone, text_alone), seq, text in zip(alone, seqs, texts):
        assert seq.output_ids == ids_alone
        assert text == text_alone


def test_a_scheduler_without_a_memory_model_runs_waves():
    """`Scheduler(memory=None)` (no memory accounting) is a supported configuration: a wave
    must not ask the absent memory model what its prompts need (it did, and crashed)."""
    from engine.model_files import load_model_dir
    from engine.prefix_cache import PrefixCache
    from engine.scheduler import Scheduler

    model, tokenizer, _ = load_model_dir(TINY_MODEL, "float32")
    scheduler = Scheduler(model, tokenizer, PrefixCache(model, max_bytes=0), context_length=2048, memory=None)
    finished = []
    for start in (10, 20, 30):
        scheduler.add(Sequence(list(range(start, start + 16)), SamplingParams(temperature=0.0, max_tokens=5,
                                                                            ignore_eos=True),
                               lambda ev: finished.append(ev) if isinstance(ev, Finished) else None))
    while scheduler.has_work:
        scheduler.step()
    assert scheduler.stats["waves"] == 1 and scheduler.stats["peak_batch"] == 3
    assert [f.completion_tokens for f in finished] == [5, 5, 5]


def test_rows_of_equal_length_attend_with_the_plain_causal_kernel():
    from engine.batch_cache import RowBatchKVCache

    batch = RowBatchKVCache.merge([KVCache(), KVCache()])
    assert batch.make_mask(5) == "causal" and batch.make_mask(1) is None
    assert batch.make_mask(5, return_array=True).shape == (2, 1, 5, 5)

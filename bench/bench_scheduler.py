"""Scheduler benchmarks: batched decode throughput, decode fairness under prefill, mixed load.

Prints each figure beside its baseline from the same run, as ratios:

* aggregate decode tokens/s at B = 1, 2, 4, 8, and B=1 against a plain
  mlx-lm `generate_step` loop on the same model (the engine's overhead);
* on a GPU, B=1 decode against the memory-bandwidth roofline (weights + KV
  bytes per token / measured copy bandwidth);
* fairness: a decoding row's tokens/s while a long prompt prefills, against
  its solo tokens/s;
* mixed load: long and short prompts submitted together vs one after another.

    python bench/bench_scheduler.py                         # CPU, the bundled model (tiny fixture if absent)
    python bench/bench_scheduler.py --model fixtures/tiny-llama
    python bench/bench_scheduler.py --random qwen3-8b       # GPU: random Qwen3-8B-shaped weights, bf16
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.engine import Engine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.sequence import Failed, Finished, Sequence  # noqa: E402

QWEN3_8B = dict(
    model_type="qwen3", hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False,
)


def random_loader(shape: dict, dtype=mx.bfloat16):
    """A loader building a random-weight model and a word-level tokenizer of its vocabulary, in memory."""

    def load():
        from mlx_lm.models import qwen3
        from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
        from tokenizers import Tokenizer, decoders, models
        from transformers import PreTrainedTokenizerFast

        model = qwen3.Model(qwen3.ModelArgs.from_dict(shape))
        model.set_dtype(dtype)
        mx.eval(model.parameters())
        # Byte-level token strings, so mlx-lm's incremental BPE detokenizer serves them
        # as it serves real models (its naive one re-decodes the whole output every token).
        vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        tok.decoder = decoders.ByteLevel()
        hf = PreTrainedTokenizerFast(tokenizer_object=tok)
        # An eos the random model will essentially never sample, so rows run to max_tokens.
        wrapper = TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids={shape["vocab_size"] - 1})
        return model, wrapper, dict(shape)

    return load


def bench_model_dir(given: Path | None) -> Path:
    """The model to measure: the one given, else the bundled default, else the tiny fixture."""
    if given is not None:
        return given
    try:
        from engine.default_model import default_model_dir

        return default_model_dir()
    except Exception:
        return ROOT / "fixtures" / "tiny-llama"


def submit(engine: Engine, prompt_ids: list[int], max_tokens: int):
    done = queue.Queue()
    seq = Sequence(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   lambda ev: done.put(ev) if isinstance(ev, (Finished, Failed)) else None)
    engine.submit(seq)
    return seq, done


def finish(done: queue.Queue) -> Finished:
    event = done.get(timeout=3600)
    if isinstance(event, Failed):
        raise event.error
    return event


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    mx.random.seed(seed)
    return mx.random.randint(10, min(vocab, 30000) - 10, (n, length)).tolist()


def aggregate_decode(engine: Engine, batch: int, tokens: int, vocab: int, together: bool = True,
                     phases: dict | None = None) -> float:
    """Tokens/s of `batch` equal-length requests, from submission to the last finish.
    together: submitted in one call, so they prefill as one wave and decode unpadded;
    otherwise one by one, as HTTP requests arrive (rows join at different lengths).
    `phases`, if given, also gets "decode": tokens after each row's first, over the span
    from the first row's first token to the last row's end (the decode phase alone)."""
    ends: dict[int, float] = {}

    def watch(done, index):
        def emit(ev):
            if isinstance(ev, (Finished, Failed)):
                ends[index] = time.perf_counter()  # runs on the engine thread as the row ends
                done.put(ev)
        return emit

    t0 = time.perf_counter()
    rows = []
    for i, p in enumerate(prompts(batch, 16, vocab, seed=batch)):
        done = queue.Queue()
        seq = Sequence(p, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), watch(done, i))
        rows.append((seq, done))
        if not together:
            engine.submit(seq)
    if together:
        engine.submit_all([seq for seq, _ in rows])
    results = [finish(done) for _, done in rows]
    wall = time.perf_counter() - t0
    if phases is not None:
        first = min(ends[i] - r.decode_s for i, r in enumerate(results))
        phases["decode"] = sum(r.completion_tokens - 1 for r in results) / (max(ends.values()) - first)
    return sum(r.completion_tokens for r in results) / wall


def mlx_lm_loop(model, tokens: int, vocab: int) -> float:
    from mlx_lm.generate import generate_step, generation_stream

    prompt = mx.array(prompts(1, 16, vocab, seed=99)[0])
    steps = generate_step(prompt, model, max_tokens=tokens)
    next(steps)  # prefill + first token outside the timing, as for the engine's steady state
    t0 = time.perf_counter()
    n = sum(1 for _ in steps)
    rate = n / (time.perf_counter() - t0)
    # generate_step leaves one step queued on its thread-local stream; MLX aborts
    # the process at exit if that work is still pending.
    mx.synchronize(generation_stream)
    return rate


def steady_batch_decode(model, batch: int, tokens: int, vocab: int, padded: bool = False) -> float:
    """tokens/s of mlx-lm's GenerationBatch alone, rows of equal length (or, padded,
    lengths 16, 17, ...: every step pays the padding mask), no scheduler: separates
    what the kernels give at this batch size from what the scheduler adds."""
    from mlx_lm.generate import GenerationBatch, StopSequences
    from mlx_lm.models.cache import make_prompt_cache

    from engine.batch_cache import RowBatchKVCache
    from engine.sampling import GREEDY

    rows = prompts(batch, 16 + batch, vocab, seed=40 + batch)
    rows = [p[: 16 + (i if padded else 0)] for i, p in enumerate(rows)]
    caches = []
    for p in rows:
        cache = make_prompt_cache(model)
        model(mx.array([p[:-1]]), cache=cache)
        caches.append(cache)
    layers = [RowBatchKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    gen = GenerationBatch(model, list(range(batch)), mx.array([p[-1] for p in rows]), layers, [p[:-1] for p in rows],
                          [GREEDY] * batch, GREEDY, [[] for _ in rows], [StopSequences()] * batch, [tokens + 8] * batch)
    gen.next()
    t0 = time.perf_counter()
    for _ in range(tokens):
        gen.next()
    return batch * tokens / (time.perf_counter() - t0)


def copy_bandwidth_gbs() -> float:
    a = mx.ones((256, 1024, 1024), dtype=mx.float32)  # 1 GiB
    mx.eval(a)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        b = a + 1.0
        mx.eval(b)
        best = max(best, 2 * a.nbytes / (time.perf_counter() - t0) / 1e9)  # read + write
        del b
    return best


def fairness(engine: Engine, long_tokens: int, vocab: int) -> dict:
    """A decoding row's rate while a long prompt prefills, against its solo rate measured
    just before and just after (their mean: the solo rate drifts as the row's KV grows)."""
    row, row_done = submit(engine, prompts(1, 16, vocab, seed=1)[0], engine.context_length - 64)
    while row.num_completion_tokens < 4:
        time.sleep(0.001)

    def rate(seconds: float) -> float:
        n0, t0 = row.num_completion_tokens, time.perf_counter()
        time.sleep(seconds)
        return (row.num_completion_tokens - n0) / (time.perf_counter() - t0)

    before = rate(2.0)
    long_seq, long_done = submit(engine, prompts(1, long_tokens, vocab, seed=2)[0], 1)
    n1, t1 = row.num_completion_tokens, time.perf_counter()
    prefill = finish(long_done)
    during = (row.num_completion_tokens - n1) / (time.perf_counter() - t1)
    after = rate(2.0)
    row.cancel()
    finish(row_done)
    solo = (before + after) / 2
    return {"solo_tok_s": round(solo, 2), "solo_before_after": [round(before, 2), round(after, 2)],
            "during_prefill_tok_s": round(during, 2), "ratio": round(during / solo, 3),
            "long_prompt_tokens": long_tokens, "long_prefill_s": round(prefill.prefill_s, 2)}


def mixed_load(engine: Engine, long_len: int, vocab: int) -> dict:
    work = [(p, 32) for p in prompts(2, long_len, vocab, seed=5)] + [(p, 32) for p in prompts(3, 64, vocab, seed=6)]
    t0 = time.perf_counter()
    for p, m in work:
        finish(submit(engine, p, m)[1])
    serial = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = [submit(engine, [t + 1 for t in p], m) for p, m in work]  # new prompts: no cache hits
    for _, done in rows:
        finish(done)
    concurrent = time.perf_counter() - t0
    return {"serial_s": round(serial, 2), "concurrent_s": round(concurrent, 2), "speedup": round(serial / concurrent, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="mlx-lm model directory (default: the bundled model)")
    parser.add_argument("--random", choices=["qwen3-8b"], help="build a random-weight model of this shape instead")
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per row")
    parser.add_argument("--long", type=int, default=2048, help="long prompt length for fairness / mixed load")
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the median is reported")
    parser.add_argument("--only", choices=["fairness", "batch"], help="run just this part")
    parser.add_argument("--decode-share", type=float, help="override scheduler.DECODE_PER_PREFILL_S (experiments)")
    args = parser.parse_args()
    if args.decode_share is not None:
        import engine.scheduler

        engine.scheduler.DECODE_PER_PREFILL_S = args.decode_share

    if args.random:
        engine = Engine("random-" + args.random, loader=random_loader(QWEN3_8B), max_batch=8,
                        prefill_step_size=args.prefill_chunk, cache_bytes=0)
    else:
        engine = Engine(bench_model_dir(args.model), dtype=args.dtype, max_batch=8, prefill_step_size=args.prefill_chunk, cache_bytes=0)
    engine.start().wait_ready(1800)
    vocab = engine.model.args.vocab_size
    result = {"device": str(mx.default_device()), "model": engine.name}

    if args.only == "fairness":
        runs = [fairness(engine, args.long, vocab) for _ in range(args.repeats)]
        result["fairness_ratios"] = [r["ratio"] for r in runs]
        result["fairness"] = sorted(runs, key=lambda r: r["ratio"])[len(runs) // 2]
        engine.shutdown()
        print(json.dumps(result, indent=2))
        return
    sizes = (1, 2, 4, 8)
    modes = ["engine"]  # (the engine's own kernels; PREFIXTRACE_SKINNY_GEMM=0: MLX's matmul)
    for kind in modes:
        for b in sizes:
            aggregate_decode(engine, b, 8, vocab)  # warm-up: the first step at a new batch shape compiles kernels
    # Repeats outermost, then modes, so a drift in the machine's speed touches every batch size and mode alike.
    runs = {(kind, b, together): [] for kind in modes for b in sizes for together in (True, False)}
    decode_phase = {(kind, b): [] for kind in modes for b in sizes}
    for _ in range(args.repeats):
        for kind in modes:
            for b in sizes:
                for together in (True, False):
                    phases = {}
                    runs[kind, b, together].append(aggregate_decode(engine, b, args.tokens, vocab, together, phases))
                    if together:
                        decode_phase[kind, b].append(phases["decode"])
    steady_runs = {(kind, padded, b): [] for kind in modes for padded in (False, True) for b in sizes}
    for _ in range(args.repeats):
        for kind in modes:
            for padded in (False, True):
                for b in sizes:
                    steady_runs[kind, padded, b].append(steady_batch_decode(engine.model, b, args.tokens, vocab, padded))
    for kind in modes:
        out = result
        if len(modes) > 1:
            out = result.setdefault("skinny_gemm", {}).setdefault(kind, {})
        agg = {b: statistics.median(runs[kind, b, True]) for b in sizes}
        staggered = {b: statistics.median(runs[kind, b, False]) for b in sizes}
        phase = {b: statistics.median(decode_phase[kind, b]) for b in sizes}
        out["decode_phase_tok_s"] = {b: round(v, 2) for b, v in phase.items()}
        out["decode_phase_speedup_vs_b1"] = {b: round(v / phase[1], 2) for b, v in phase.items()}
        out["aggregate_runs_tok_s"] = {f"B{b}{'' if t else '_one_by_one'}": [round(x, 1) for x in runs[kind, b, t]]
                                       for b in sizes for t in (True, False)}
        out["aggregate_decode_tok_s"] = {b: round(v, 2) for b, v in agg.items()}
        out["batch_speedup_vs_b1"] = {b: round(v / agg[1], 2) for b, v in agg.items()}
        out["one_by_one_decode_tok_s"] = {b: round(v, 2) for b, v in staggered.items()}
        out["one_by_one_speedup_vs_b1"] = {b: round(v / agg[1], 2) for b, v in staggered.items()}
        for name, padded in (("generation_batch_alone", False), ("generation_batch_alone_padded", True)):
            steady = {b: statistics.median(steady_runs[kind, padded, b]) for b in sizes}
            out[f"{name}_tok_s"] = {b: round(v, 2) for b, v in steady.items()}
            out[f"{name}_speedup_vs_b1"] = {b: round(v / steady[1], 2) for b, v in steady.items()}
    agg = {b: statistics.median(runs[modes[0], b, True]) for b in sizes}  # B=1 takes no skinny path: any mode
    plain = statistics.median(mlx_lm_loop(engine.model, args.tokens, vocab) for _ in range(args.repeats))
    result["mlx_lm_loop_b1_tok_s"] = round(plain, 2)
    result["engine_b1_vs_mlx_lm_loop"] = round(agg[1] / plain, 3)
    if mx.default_device() == mx.gpu:
        weights = sum(v.nbytes for _, v in __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(engine.model.parameters()))
        a = engine.model.args
        kv_per_token = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * 2
        bytes_per_token = weights + kv_per_token * (16 + args.tokens // 2)
        bw = copy_bandwidth_gbs()
        roofline = bw * 1e9 / bytes_per_token
        result.update(copy_bandwidth_gb_s=round(bw, 1), weights_gb=round(weights / 1e9, 2), roofline_b1_tok_s=round(roofline, 2),
                      engine_b1_of_roofline=round(agg[1] / roofline, 3), mlx_lm_loop_of_roofline=round(plain / roofline, 3))
    if args.only == "batch":
        engine.shutdown()
        print(json.dumps(result, indent=2))
        return
    runs = [fairness(engine, args.long, vocab) for _ in range(args.repeats)]
    result["fairness"] = sorted(runs, key=lambda r: r["ratio"])[len(runs) // 2]
    result["fairness_ratios"] = [r["ratio"] for r in runs]
    result["mixed_load"] = mixed_load(engine, args.long, vocab)
    engine.shutdown()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Compare grammar libraries for constrained tool calls on this machine (docs/TOOLS.md).

For llguidance, xgrammar and outlines-core, on the bundled SmolLM2's tokenizer (49,152 tokens):
  - tokenizer setup: building the library's view of the vocabulary (once per model);
  - compile: a Hermes tool-call grammar for two coding-agent tools (once per request);
  - mask: the per-token allowed-token mask, averaged while walking a valid call token by token;
  - apply: turning that mask into MLX logits (`mx.where` over the vocabulary);
  - decode (`--decode`): the engine's B=1 decode tokens/s on the model, free against grammar-constrained
    (llguidance, a JSON array of integers long enough to run to max_tokens), alternated in one run.

A library that does not import here is reported with the reason. xgrammar imports torch, which this
project does not depend on; to measure it anyway, install torch and xgrammar into a side directory and
name it: `--extra-path /tmp/xgt:/tmp/xg`.

    python bench/bench_grammar.py [--model DIR] [--extra-path DIRS] [--repeat 5] [--decode]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOOLS = [
    {"name": "Read", "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}},
                                    "required": ["file_path"]}},
    {"name": "Bash", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}, "timeout": {"type": "integer", "minimum": 1}},
        "required": ["command"]}},
]
# The call a grammar must accept (and the bench walks token by token).
VALID_CALL = '{"name": "Read", "arguments": {"file_path": "hello.txt"}}'


def call_schema() -> dict:
    """The tool-call object: one of the tools, by name, with arguments of its schema."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in TOOLS]}


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def timed(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def bench_llguidance(hf, n_vocab, tokens, repeat):
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tok, setup = timed(lambda: llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab), 1)
    from engine.grammar import JSON_OPTIONS

    grammar = llguidance.LLMatcher.grammar_from_json_schema(call_schema(), defaults=JSON_OPTIONS)
    matcher, compile_s = timed(lambda: llguidance.LLMatcher(tok, grammar), repeat)
    assert not matcher.is_error(), matcher.get_error()
    mask = allocate_token_bitmask(1, n_vocab)
    per = []
    for t in tokens:
        t0 = time.perf_counter()
        fill_next_token_bitmask(matcher, mask)
        per.append(time.perf_counter() - t0)
        assert (mask[0, t // 32] >> (t % 32)) & 1, "a token of the valid call was masked"
        assert matcher.consume_token(t)
    return {"version": "1.9.1",
            "setup_ms": ms(setup), "compile_ms": ms(compile_s), "mask_ms": ms(statistics.mean(per)),
            "mask_p99_ms": ms(sorted(per)[int(len(per) * 0.99)]), "bitmask": mask}


def bench_xgrammar(hf, n_vocab, tokens, repeat):
    import xgrammar as xgr

    info, setup = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=n_vocab), 1)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(call_schema()),
                                                                     any_whitespace=False), repeat)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, n_vocab)
    per = []
    for t in tokens:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        per.append(time.perf_counter() - t0)
        assert matcher.accept_token(t), "a token of the valid call was refused"
    return {"version": "0.2.8", "setup_ms": ms(setup), "compile_ms": ms(compile_s),
            "mask_ms": ms(statistics.mean(per)), "mask_p99_ms": ms(sorted(per)[int(len(per) * 0.99)])}


def bench_outlines_core(hf, n_vocab, tokens, repeat, eos_id):
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    from mlx_lm.tokenizer_utils import _byte_decoder

    def vocabulary():
        # outlines-core wants each token's bytes; byte-level BPE spells them with GPT-2's byte map.
        decode = _byte_decoder()
        table: dict[bytes, list[int]] = {}
        for text, i in hf.get_vocab().items():
            if i == eos_id:
                continue
            raw = bytes(decode[c] for c in text) if all(c in decode for c in text) else text.encode()
            table.setdefault(raw, []).append(i)
        return outlines_core.Vocabulary(eos_id, table)

    vocab, setup = timed(vocabulary, 1)
    regex = build_regex_from_schema(json.dumps(call_schema()))
    index, compile_s = timed(lambda: outlines_core.Index(regex, vocab), repeat)
    guide = outlines_core.Guide(index)
    per = []
    for t in tokens:
        t0 = time.perf_counter()
        allowed = guide.get_tokens()
        mask = np.zeros(n_vocab, dtype=bool)
        mask[allowed] = True
        per.append(time.perf_counter() - t0)
        assert mask[t], "a token of the valid call was masked"
        guide.advance(t)
    return {"version": "0.2.14", "setup_ms": ms(setup), "compile_ms": ms(compile_s),
            "mask_ms": ms(statistics.mean(per)), "mask_p99_ms": ms(sorted(per)[int(len(per) * 0.99)])}


def bench_apply(bitmask, n_vocab, repeat=200):
    """Bitmask → MLX logits, the way engine/grammar.py applies it."""
    import mlx.core as mx

    from engine.grammar import apply_bitmask

    logits = mx.random.normal((1, n_vocab))
    mx.eval(logits)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval(apply_bitmask(logits, bitmask[0], n_vocab))
        times.append(time.perf_counter() - t0)
    return ms(statistics.median(times))


def bench_decode(model_dir: Path, repeat: int, tokens: int = 64) -> dict:
    """B=1 decode tokens/s through the engine: a free row against a grammar-constrained one."""
    import queue

    from engine.engine import Engine
    from engine.sampling import SamplingParams
    from engine.sequence import Failed, Finished, Sequence

    from engine.cpu_runtime import default_dtype

    engine = Engine(model_dir, name="bench", dtype=default_dtype()).start()
    engine.wait_ready(600)
    prompt = engine.render([{"role": "user", "content": "Count from one to one hundred."}]).token_ids

    def run(constrained: bool) -> float:
        events: queue.Queue = queue.Queue()
        seq = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), events.put)
        if constrained:
            seq.logits_processors = [engine.grammar.json_schema({"type": "array", "items": {"type": "integer"}})]
        engine.submit(seq)
        while True:
            event = events.get(timeout=600)
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Finished):
                return (event.completion_tokens - 1) / max(event.decode_s, 1e-9)

    run(False), run(True)  # warm-up (and llguidance's tokenizer, built once)
    free, constrained = [], []
    for _ in range(repeat):
        free.append(run(False))
        constrained.append(run(True))
    engine.shutdown()
    f, c = statistics.median(free), statistics.median(constrained)
    return {"free_tok_s": round(f, 1), "constrained_tok_s": round(c, 1), "constrained_vs_free": round(c / f, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the bundled SmolLM2)")
    ap.add_argument("--extra-path", default="", help="colon-separated directories put on sys.path (xgrammar)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--decode", action="store_true", help="also measure B=1 decode, free vs constrained")
    args = ap.parse_args()
    if sys.platform == "linux" and args.decode:
        from engine.cpu_runtime import maybe_reexec_with_openblas

        maybe_reexec_with_openblas()  # as `prefixtrace serve` runs the engine on the CPU
    for p in filter(None, args.extra_path.split(":")):
        sys.path.append(p)
    from mlx_lm.tokenizer_utils import load

    if args.model:
        model_dir = Path(args.model)
    else:
        from engine.default_model import default_model_dir
        model_dir = default_model_dir()
    wrapper = load(model_dir)
    hf = wrapper._tokenizer
    n_vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokens = hf.encode(VALID_CALL, add_special_tokens=False)
    eos = hf.eos_token_id
    print(f"model {model_dir.name}: vocab {n_vocab}; walking a {len(tokens)}-token call; "
          f"compile median of {args.repeat}")
    results = {}
    for name, fn in (("llguidance", lambda: bench_llguidance(hf, n_vocab, tokens, args.repeat)),
                     ("xgrammar", lambda: bench_xgrammar(hf, n_vocab, tokens, args.repeat)),
                     ("outlines-core", lambda: bench_outlines_core(hf, n_vocab, tokens, args.repeat, eos))):
        try:
            results[name] = fn()
        except Exception as exc:  # ImportError for a missing dependency, or a library failure
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    bitmask = results.get("llguidance", {}).pop("bitmask", None)
    if bitmask is not None:
        results["llguidance"]["apply_mlx_ms"] = bench_apply(bitmask, n_vocab)
    for name, r in results.items():
        print(f"{name:14s} " + json.dumps(r))
    ok = {k: v for k, v in results.items() if "mask_ms" in v}
    if "llguidance" in ok:
        base = ok["llguidance"]
        for k, v in ok.items():
            print(f"{k:14s} compile x{v['compile_ms'] / max(base['compile_ms'], 1e-9):.1f}, "
                  f"mask x{v['mask_ms'] / max(base['mask_ms'], 1e-9):.1f} of llguidance's")
    if args.decode:
        print("decode B=1 " + json.dumps(bench_decode(model_dir, args.repeat)))


if __name__ == "__main__":
    main()

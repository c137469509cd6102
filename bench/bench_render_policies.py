"""Render policies (issue 9): re-prefilled tokens and prefill seconds of one scripted
harness session under `fold` + `template` against `inline` + `loop`.

    python bench/bench_render_policies.py [--tiny] [--template fixtures/templates/qwen35_style.jinja]
        [--scale 1.0] [--block-size 256] [--repeat 3] [--json]

The session (testsupport/harness_session.py): one real user prompt, then an
agent loop of tool calls with reasoning, interrupted by harness notices sent as user-role
messages (a todo update, a subagent result, a background-job notice) and a
mid-conversation system update. Each request is rendered by the embedded
engine under the given policies and prefilled (max_tokens=1, greedy); the
engine's prefix cache reports the cached tokens of each turn. The model is the
CPU default (SmolLM2-135M, else fixtures/tiny-llama) with its chat template
replaced by the fixture template, in a temporary model directory of symlinks.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testsupport.harness_session import harness_session, model_dir_with_template  # noqa: E402

DEFAULT_TEMPLATE = ROOT / "fixtures" / "templates" / "qwen35_style.jinja"
SETTINGS = (("fold", "template"), ("inline", "loop"))


def replay(model_dir: Path, loader, bodies: list[dict], mid: str, retention: str, block_size: int) -> dict:
    from bench.engine_io import ttft as prefill
    from engine.engine import Engine

    engine = Engine(model_dir, loader=loader, block_size=block_size, mid_system_policy=mid,
                    thinking_retention=retention).start()
    engine.wait_ready(600)
    try:
        prefill(engine, [5, 6, 7, 8] * 8)  # warm the kernels on an unrelated prompt
        turns = []
        for body in bodies:
            r = engine.render(body["messages"], tools=body.get("tools"))
            seconds, cached = prefill(engine, r.token_ids)
            turns.append({"prompt": len(r.token_ids), "cached": cached, "uncached": len(r.token_ids) - cached,
                          "seconds": round(seconds, 3), "policy": r.policy})
    finally:
        engine.shutdown()
    return {
        "setting": f"{mid}+{retention}",
        "turns": turns,
        "uncached_tokens": sum(t["uncached"] for t in turns),
        "reprefilled_tokens": sum(t["uncached"] for t in turns[1:]),  # beyond the cold first prompt
        # turns that reused every whole block of the previous prompt
        "full_hits": sum(1 for a, b in zip(turns, turns[1:]) if b["cached"] >= a["prompt"] // block_size * block_size),
        "prefill_seconds": round(sum(t["seconds"] for t in turns), 2),
    }


def pick_model(tiny: bool):
    if not tiny:
        try:
            from engine.cpu_runtime import load_model
            from engine.default_model import default_model_dir

            src = default_model_dir()
            return src, load_model, "SmolLM2-135M (float32, CPU default)"
        except Exception as exc:  # no wheel, no network: fall back to the fixture
            print(f"default model unavailable ({exc}); using fixtures/tiny-llama")
    from engine.model_files import load_model as load_plain

    return ROOT / "fixtures" / "tiny-llama", lambda d: load_plain(d, "float32"), "tiny-llama (float32 fixture)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="use fixtures/tiny-llama")
    parser.add_argument("--template", type=Path, default=DEFAULT_TEMPLATE)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every generated text's length")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=1,
                        help="replay each setting this many times (alternating) and report the median seconds")
    parser.add_argument("--json", action="store_true", help="print the per-turn results as JSON too")
    args = parser.parse_args()
    if sys.platform == "linux" and not args.tiny:
        from engine.cpu_runtime import maybe_reexec_with_openblas

        maybe_reexec_with_openblas()
    src, load, label = pick_model(args.tiny)
    bodies = harness_session(args.scale)
    work = Path(tempfile.mkdtemp(prefix="bench-render-policies-"))
    try:
        model_dir = model_dir_with_template(src, args.template, work / "model")
        config = json.loads((model_dir / "config.json").read_text())
        loader = lambda: (*load(model_dir)[:2], config)  # noqa: E731
        print(f"model {label}; template {args.template.name}; {len(bodies)} requests; block size {args.block_size}")
        runs = [[replay(model_dir, loader, bodies, mid, ret, args.block_size) for mid, ret in SETTINGS]
                for _ in range(max(1, args.repeat))]
        results = []
        for i in range(len(SETTINGS)):  # token counts are deterministic; seconds are not: take the median run
            by_time = sorted((run[i] for run in runs), key=lambda r: r["prefill_seconds"])
            best = by_time[len(by_time) // 2]
            best["prefill_seconds_all"] = [r["prefill_seconds"] for r in (run[i] for run in runs)]
            results.append(best)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'setting':<16} {'uncached':>9} {'re-prefilled':>13} {'full hits':>10} {'prefill s':>10}  per-turn uncached")
    for r in results:
        print(f"{r['setting']:<16} {r['uncached_tokens']:>9} {r['reprefilled_tokens']:>13} "
              f"{r['full_hits']:>5}/{len(r['turns']) - 1:<4} {r['prefill_seconds']:>10}  "
              + " ".join(str(t["uncached"]) for t in r["turns"]))
    if args.repeat > 1:
        print("prefill seconds of every run: " + "; ".join(f"{r['setting']} {r['prefill_seconds_all']}" for r in results))
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Render policies (issue 9): re-prefilled tokens and prefill seconds of one scripted
harness session under `fold` + `template` against `inline` + `loop`.

    python bench/bench_render_policies.py [--tiny] [--template fixtures/templates/qwen35_style.jinja]
        [--scale 1.0] [--block-size 256] [--repeat 3] [--json]

The session (`harness_session`): one real user prompt, then an agent loop of
tool calls with reasoning, interrupted by harness notices sent as user-role
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
import random
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_TEMPLATE = ROOT / "fixtures" / "templates" / "qwen35_style.jinja"
SETTINGS = (("fold", "template"), ("inline", "loop"))
_WORDS = ("parse", "line", "token", "buffer", "state", "index", "value", "error", "test", "case", "config", "module",
          "return", "call", "site", "assert", "expected", "actual", "offset", "field", "record", "header", "split",
          "strip", "format", "cache", "prefix", "count", "list", "dict", "loop", "branch", "fixture", "commit")


def _prose(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        out.append(rng.choice(_WORDS))
        if i % 12 == 11:
            out.append(".\n")
    return " ".join(out).replace(" .\n ", ".\n")


def _code(rng: random.Random, lines: int) -> str:
    return "\n".join(f"{n:4d}  {rng.choice(_WORDS)}_{rng.choice(_WORDS)} = {rng.choice(_WORDS)}({rng.randint(0, 99)})"
                     for n in range(1, lines + 1))


def _call(i: int, name: str, **args) -> list[dict]:
    return [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]


def harness_session(scale: float = 1.0, follow_up: bool = False, seed: int = 9) -> list[dict]:
    """The request bodies a coding harness sends in one scripted session, in order.

    One real user prompt, then one agent loop: reasoning + tool calls, todo/subagent/
    background-job notices as user-role messages, and a system update mid-conversation.
    `follow_up` adds a second real user prompt (a legitimate loop boundary) and one more loop.
    """
    rng = random.Random(seed)
    n = lambda k: max(4, int(k * scale))  # noqa: E731
    tools = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                                  "parameters": {"type": "object", "properties": {}}}}
             for name in ("read_file", "edit_file", "run_tests", "todo_write", "spawn_subagent")]
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent working in a git checkout.\n"
                                                          + _prose(rng, n(200))}]
    bodies: list[dict] = []
    calls = iter(range(1, 100))

    def send() -> None:
        bodies.append({"model": "default", "messages": list(messages), "tools": tools})

    def reply(reasoning_words: int, tool_name: str | None = None, content: str = "", **args) -> None:
        msg = {"role": "assistant", "content": content, "reasoning_content": _prose(rng, n(reasoning_words))}
        if tool_name:
            msg["tool_calls"] = _call(next(calls), tool_name, **args)
        messages.append(msg)

    def tool(content: str) -> None:
        messages.append({"role": "tool", "tool_call_id": messages[-1]["tool_calls"][0]["id"], "content": content})

    messages.append({"role": "user", "content": "Fix the failing test in src/parser.py and keep the todo list current."})
    send(); reply(120, "read_file", path="src/parser.py")  # noqa: E702
    tool(_code(rng, n(60)))
    send(); reply(80, "todo_write", todos=["read parser.py", "fix the test", "run the suite"])  # noqa: E702
    tool("ok")
    messages.append({"role": "user", "content": "<todo-update>\n- [x] read parser.py\n- [ ] fix the test\n"
                                                "- [ ] run the suite\n</todo-update>"})
    send(); reply(100, "run_tests", args="-q")  # noqa: E702
    tool(_prose(rng, n(150)))
    messages.append({"role": "system", "content": "Project update: tests now run with `pytest -x -q`; "
                                                  "never edit files under vendor/."})
    send(); reply(140, "edit_file", path="src/parser.py", patch=_code(rng, n(10)))  # noqa: E702
    tool("applied")
    send(); reply(60, "spawn_subagent", task="find every call site of parse_line")  # noqa: E702
    tool("subagent explorer-1 started in the background")
    messages.append({"role": "user", "content": "[subagent result] explorer-1: " + _prose(rng, n(80))})
    send(); reply(90, "run_tests", args="-x -q")  # noqa: E702
    tool(_prose(rng, n(120)))
    send(); reply(80, "read_file", path="src/lexer.py")  # noqa: E702
    tool(_code(rng, n(40)))
    messages.append({"role": "user", "content": "<background-job id=7 status=done>\nlint: 0 errors\n</background-job>"})
    send(); reply(70, content="The parser test passes now; lint is clean.")  # noqa: E702
    if follow_up:
        messages.append({"role": "user", "content": "Now add a docstring to parse_line."})
        send(); reply(60, "edit_file", path="src/parser.py", patch=_code(rng, n(6)))  # noqa: E702
        tool("applied")
        send(); reply(30, content="Done.")  # noqa: E702
    return bodies


def model_dir_with_template(src: Path, template: Path, dst: Path) -> Path:
    """A model directory of symlinks to `src` whose tokenizer_config.json carries `template`."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "tokenizer_config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((src / "tokenizer_config.json").read_text())
    config["chat_template"] = Path(template).read_text()
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


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

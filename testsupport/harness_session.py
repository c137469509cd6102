"""A scripted coding-harness session (the request bodies, in order) and a model directory whose chat
template is swapped: what tests/test_render_policy.py checks the render policies on and
bench/bench_render_policies.py replays through the engine (docs/RENDER_POLICIES.md)."""

from __future__ import annotations

import json
import random
from pathlib import Path

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

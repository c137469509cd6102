"""What a large agent body costs the proxy before it goes upstream (issue 17): the JSON parse and
the nesting check (proxy/request_limits.py `check_depth`), beside the check it replaced, one run.

The body: the largest request in ../shared/traffic (pi's and Claude Code's recordings), grown to
`--kb` with the shapes an agent's history has (text parts with code in them, assistant tool calls).

    python bench/bench_body_check.py            # 270 KB, 200 runs each
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

from proxy.request_limits import check_depth

TRAFFIC = Path(__file__).resolve().parents[1] / ".." / "shared" / "traffic"


def old_check_depth(value, limit: int = 100) -> None:
    """The check before issue 17's fourth round (an explicit stack, a generator per container)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise ValueError("too deep")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def agent_body(kb: int) -> bytes:
    rows = []
    for name in ("pi_smol.jsonl", "claude_smol.jsonl"):
        path = TRAFFIC / name
        if path.exists():
            rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    bodies = [r["request"] for r in rows if isinstance(r.get("request"), dict) and "messages" in r["request"]]
    body = max(bodies, key=lambda b: len(json.dumps(b))) if bodies else {"messages": [], "tools": []}
    messages = body["messages"]
    while len(json.dumps(body)) < kb * 1000:
        messages.append({"role": "user", "content": [{"type": "text", "text": "def f(x): return [x, {'a': x}] " * 30}]})
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "read", "arguments": json.dumps({"path": "a/b.py", "lines": [1, 2, 3]})}}]})
    return json.dumps(body).encode()


def timed_ms(fn, n: int) -> float:
    fn()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1000
    finally:
        gc.enable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kb", type=int, default=270)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    raw = agent_body(args.kb)
    value = json.loads(raw)
    print(f"body {len(raw) / 1000:.0f} KB, {len(value['messages'])} messages, {len(value.get('tools') or [])} tools, "
          f"{raw.count(b'[') + raw.count(b'{')} brackets")
    for r in range(args.rounds):
        parse = timed_ms(lambda: json.loads(raw), args.n)
        old = timed_ms(lambda: old_check_depth(value), args.n)
        new = timed_ms(lambda: check_depth(value), args.n)
        print(f"round {r + 1}: json.loads {parse:.3f} ms | depth check before {old:.3f} ms, now {new:.3f} ms "
              f"({old / new:.1f}x)")


if __name__ == "__main__":
    main()

"""Cache hits and TTFT of a fleet under each router, side by side in one run.

N sessions x M turns (growing conversations that share one system prompt, as a team's agents do)
go through a prefixtrace proxy in front of 3 `prefixtrace serve` workers on the tiny model, routed by:

  sglang-router cache_aware, round_robin and manual (sticky on X-SMG-Routing-Key),
  vllm-router cache_aware, consistent_hash and sticky_least_loaded (X-Session-Id),
  the proxy's own affinity (`serve --upstream W1 --upstream W2 --upstream W3`, proxy/upstream_pool.py).

Each router runs against the same workers; each policy gets conversations of its own (a salt at the
start of the system prompt), so no policy is served from what an earlier one left in the caches.
Printed per policy: the cache hit rate (cached / prompt tokens, as the workers reported them), TTFT
median and p90 at the client, and how many turns a session changed worker on (from `served_by`).

    python bench/bench_fleet_routing.py [--sessions 6] [--turns 6] [--workers 3] [--concurrency 3] [--rounds 1]

A router that is not installed (pip install sglang-router vllm-router) is left out with a line saying so.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testsupport.fleet import front_proxy, router, router_available, workers  # noqa: E402
from testsupport.servers import TINY_MODEL  # noqa: E402

SYSTEM = ("You are a coding agent working in a large repository. Follow the repository's style, run the "
          "tests you touch, keep changes small and explain each step before you take it. Tools: read_file, "
          "write_file, run_tests, search. ") * 4


def chat_turn(client: httpx.Client, url: str, session: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed turn; returns its TTFT, the usage the worker reported and the reply."""
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as r:
        r.raise_for_status()
        import json

        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            for c in chunk.get("choices") or ():
                text.append((c.get("delta") or {}).get("content") or "")
            usage = chunk.get("usage") or usage
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {"ttft": ttft, "prompt": usage["prompt_tokens"], "cached": details.get("cached_tokens") or 0,
            "reply": "".join(text)}


def run_sessions(url: str, salt: str, sessions: int, turns: int, concurrency: int, max_tokens: int) -> list[dict]:
    """`sessions` conversations of `turns` turns each, `concurrency` at a time, turn by turn."""
    results: list[dict] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        sid = f"{salt}-s{i}"
        messages = [{"role": "system", "content": f"[{salt}] " + SYSTEM},
                    {"role": "user", "content": f"Task {i}: fix the flaky test number {i * 7919} in module m{i}."}]
        with httpx.Client(timeout=120) as client:
            for t in range(turns):
                out = chat_turn(client, url, sid, messages, max_tokens)
                with lock:
                    results.append({"session": sid, "turn": t, **out})
                messages = messages + [{"role": "assistant", "content": out["reply"] or "ok"},
                                       {"role": "user", "content": f"Turn {t}: the test still fails with "
                                        f"AssertionError at line {100 + t * 13}; look at the fixture next."}]

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(sessions)))
    return results


def hop_ttft_ms(url: str, n: int = 20) -> float:
    """Median TTFT of `n` small streamed requests to `url` (one worker, or a router in front of it)."""
    import json

    out = []
    with httpx.Client(timeout=60) as client:
        for i in range(n):
            t0, got = time.perf_counter(), None
            body = {"model": "default", "max_tokens": 4, "stream": True,
                    "messages": [{"role": "user", "content": f"hello {i % 2}"}]}
            with client.stream("POST", url + "/v1/chat/completions", json=body,
                               headers={"X-Session-Id": "hop", "X-SMG-Routing-Key": "hop"}) as r:
                for line in r.iter_lines():
                    if got is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                        got = time.perf_counter() - t0
            out.append(got)
    return 1000 * statistics.median(out)


def worker_changes(db: Path) -> tuple[int, int]:
    """(turns served by another worker than the session's previous turn, turns after a first)."""
    con = sqlite3.connect(db)
    rows = con.execute("select session_id, served_by from turn_log order by started_at").fetchall()
    con.close()
    last: dict[str, str] = {}
    changes = later = 0
    for session, served in rows:
        if session in last:
            later += 1
            changes += served != last[session]
        last[session] = served
    return changes, later


def summarize(name: str, results: list[dict], changes: tuple[int, int]) -> dict:
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)
    later = [r["ttft"] for r in results if r["turn"] > 0 and r["ttft"] is not None]
    later.sort()
    return {"policy": name, "turns": len(results), "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_median_ms": 1000 * statistics.median(later),
            "ttft_p90_ms": 1000 * later[min(len(later) - 1, int(0.9 * len(later)))],
            "worker_changes": f"{changes[0]}/{changes[1]}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=3, help="sessions in flight at once")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16, help="the workers' prefix-cache block (tokens)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every policy this many times, the order reversed each round (load drifts); "
                         "figures are over all rounds")
    ap.add_argument("--model", type=Path, default=TINY_MODEL,
                    help="the workers' model (default: the tiny test model, whose prefill is too cheap for a "
                         "miss to show in TTFT)")
    args = ap.parse_args()

    policies = [("sglang", "cache_aware"), ("sglang", "round_robin"), ("sglang", "manual"),
                ("vllm", "cache_aware"), ("vllm", "consistent_hash"), ("vllm", "sticky_least_loaded"),
                ("proxy", "affinity")]
    results: dict[str, list[dict]] = {}
    changes: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        fleet = stack.enter_context(workers(args.workers, tmp, block_size=args.block_size, model=args.model))
        urls = [u for u, _, _ in fleet]
        print(f"{args.workers} workers ({args.model.name}, block {args.block_size}), {args.sessions} sessions x "
              f"{args.turns} turns, {args.concurrency} at a time, {args.rounds} round(s)", flush=True)
        # What one router hop adds: the same small requests to one worker, directly and through each router.
        hops = {"direct": hop_ttft_ms(urls[0])}
        for kind, policy in (("sglang", "manual"), ("vllm", "consistent_hash")):
            if router_available(kind) is None:
                with router(kind, policy, urls[:1]) as (rurl, _):
                    hops[f"{kind}-router"] = hop_ttft_ms(rurl)
        print("one hop, median TTFT of 20 small streamed requests to one worker: " +
              ", ".join(f"{k} {v:.1f} ms" for k, v in hops.items()), flush=True)
        for r in range(args.rounds):
            for kind, policy in policies if r % 2 == 0 else policies[::-1]:
                name = f"{kind}-router {policy}" if kind != "proxy" else "prefixtrace --upstream x3 (own affinity)"
                why = router_available(kind) if kind != "proxy" else None
                if why:
                    if r == 0:
                        print(f"{name}: skipped, {why}", flush=True)
                    continue
                db = tmp / f"front-{kind}-{policy}-{r}.db"
                with ExitStack() as run:
                    upstreams = urls if kind == "proxy" else [run.enter_context(router(kind, policy, urls))[0]]
                    front, rec = run.enter_context(front_proxy(upstreams, db))
                    got = run_sessions(front, f"{kind}-{policy}-r{r}", args.sessions, args.turns, args.concurrency,
                                       args.max_tokens)
                    rec.flush()
                results.setdefault(name, []).extend(got)
                moved, later = worker_changes(db)
                total = changes.setdefault(name, [0, 0])
                total[0] += moved
                total[1] += later
                print(f"  done: {name} (round {r + 1})", flush=True)
    table = [summarize(name, got, tuple(changes[name])) for name, got in results.items()]

    print()
    print(f"{'policy':44} {'turns':>5} {'hit rate':>9} {'TTFT med ms':>12} {'TTFT p90 ms':>12} {'worker changes':>15}")
    for row in table:
        print(f"{row['policy']:44} {row['turns']:>5} {row['hit_rate']:>9.1%} {row['ttft_median_ms']:>12.1f} "
              f"{row['ttft_p90_ms']:>12.1f} {row['worker_changes']:>15}")
    print("\nhit rate: cached / prompt tokens as the workers reported them; TTFT at the client, turns after the "
          "first; worker changes: turns served by another worker than the session's previous turn.")


if __name__ == "__main__":
    main()

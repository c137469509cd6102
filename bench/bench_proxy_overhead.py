"""What the proxy adds in `--upstream` mode (issue 17): TTFT and whole-request time, p50.

    python bench/bench_proxy_overhead.py [--requests 40] [--max-tokens 8]

Starts two real servers on loopback: an upstream `prefixtrace serve` with the embedded
engine on the tiny fixture model, and a second `prefixtrace serve --upstream` in front of
it with its recorder on (its own SQLite file). The same short streamed chat requests are
sent alternately straight to the upstream and through the proxy, one at a time; each
request's time to its first content chunk and to its end are taken on the client.
Prints medians and p90s of both paths and the added p50 (goal: <= 1 ms added TTFT).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], work: Path, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(work / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "prefixtrace.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), "--db", str(work / f"{name}.db"), *args],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited; see {work / (name + '.log')}")
        time.sleep(0.3)
    raise SystemExit(f"{name} did not come up")


def one(client: httpx.Client, url: str, model: str, i: int, max_tokens: int) -> tuple[float, float]:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"request {i}: say something short"}]}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - t0, end - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=40, help="per path")
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    upstream = proxy = None
    try:
        upstream, up_url = start(["--model", str(ROOT / "fixtures" / "tiny-llama"), "--dtype", "float32"], work,
                                 "upstream")
        proxy, px_url = start(["--upstream", up_url], work, "proxy")
        model = httpx.get(f"{up_url}/v1/models").json()["data"][0]["id"]
        times = {"direct": [], "proxy": []}
        with httpx.Client(timeout=60) as client:
            for i in range(4):  # warm both paths (connections, kernels)
                one(client, up_url, model, 1000 + i, args.max_tokens)
                one(client, px_url, model, 1000 + i, args.max_tokens)
            for i in range(args.requests):
                for name, url in (("direct", up_url), ("proxy", px_url)) if i % 2 == 0 else \
                        (("proxy", px_url), ("direct", up_url)):
                    times[name].append(one(client, url, model, i, args.max_tokens))
        out = {"requests_per_path": args.requests, "load_average": os.getloadavg()[0]}
        for name, rows in times.items():
            ttft = sorted(t for t, _ in rows)
            total = sorted(t for _, t in rows)
            out[name] = {"ttft_p50_ms": round(statistics.median(ttft) * 1e3, 2),
                         "ttft_p90_ms": round(ttft[int(0.9 * len(ttft))] * 1e3, 2),
                         "total_p50_ms": round(statistics.median(total) * 1e3, 2)}
        out["added_ttft_p50_ms"] = round(out["proxy"]["ttft_p50_ms"] - out["direct"]["ttft_p50_ms"], 2)
        out["added_total_p50_ms"] = round(out["proxy"]["total_p50_ms"] - out["direct"]["total_p50_ms"], 2)
        print(json.dumps(out, indent=2))
    finally:
        for proc in (proxy, upstream):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()

"""Where a proxied streamed turn's time goes, stage by stage (issue 17; a profile, not a test).

Starts an upstream `prefixtrace serve --model fixtures/tiny-llama` and one proxy per tree
(`prefixtrace serve --upstream <it>`: this tree, and `--baseline TREE` if given), every server with
stage stamps put in at start (no source change: the stamps wrap a few functions). Each stamp is
`time.perf_counter_ns()` (CLOCK_MONOTONIC: one clock for every process here) and
`time.thread_time_ns()` (the loop thread's own CPU). Then sends `--n` streamed requests of one route
(`--route chat|messages|responses`, as bench_proxy_overhead.py sends them) to each proxy, alternating, each tagged with an `X-Stage-Id` header that the proxy forwards, so the upstream's
stamps pair with the proxy's. Stages, on the proxy's loop thread:

    app      the request handed to the app (ProxyApp.__call__)
    body     the body read (read_request_body returned)
    sent     the turn's POST written to the socket (UpstreamConnections._write returned; the upstream
             may be reading it before this returns)
    head     the upstream's response head parsed (UpstreamConnections.request returned)
    started  the response head written (uvicorn's send of http.response.start returned)
    content  the first content delta written (uvicorn's send of it returned)

and across processes: the client's send -> the proxy's `app`; the proxy's `sent` -> the upstream's
`app`; the upstream's `content` -> the proxy's `content`; the proxy's `content` -> the client's
first content delta read.

    python bench/profile_proxy_stages.py --n 40 --baseline /tmp/main      # medians, ms
    python bench/profile_proxy_stages.py --n 40 --route messages          # the same for /v1/messages

The upstream's own `started` (its response head written) is stamped too: on /v1/responses the
engine sends its head and `response.created` before prefill, on chat and messages only after it,
so there the proxy's head work is on the path to the first content.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

# The first content delta of each route as the servers write it (compact JSON): chat's `"content":"x`
# (a role chunk's `"content":""` is not content), Messages' text_delta, Responses' output_text delta.
NON_EMPTY_CONTENT = re.compile(rb'"content":"[^"]|"text_delta","text":"[^"]|"response\.output_text\.delta".*"delta":"[^"]')
STAGES = ("app", "body", "sent", "head", "started", "content")


def install_stamps(out_path: str) -> None:
    """In a server process, before it starts: wrap the stage functions, one JSON line per request."""
    import asyncio

    from proxy import relay, upstream_http
    from proxy.app import ProxyApp

    out = open(out_path, "a", buffering=1)  # noqa: SIM115 (open for the server's life)
    current: dict = {}  # task -> stamps

    def stamp(name: str) -> None:
        stamps = current.get(asyncio.current_task())
        if stamps is not None and name not in stamps:
            stamps[name] = (time.perf_counter_ns(), time.thread_time_ns())

    app_call = ProxyApp.__call__

    async def call(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await app_call(self, scope, receive, send)
        task = asyncio.current_task()
        stamps = current[task] = {"app": (time.perf_counter_ns(), time.thread_time_ns())}
        tag = dict(scope["headers"]).get(b"x-stage-id", b"").decode()

        try:
            await app_call(self, scope, receive, send)
        finally:
            current.pop(task, None)
            out.write(json.dumps({"id": tag, **stamps}) + "\n")

    # The sends stamped where uvicorn writes them (its request cycle's own `send`): what prefixtrace
    # does after that write (the access line, since issue 17's fourth round) comes after the stamp.
    for cycle_class in _cycle_classes():
        cycle_send = cycle_class.send

        async def stamped_send(self, message, _send=cycle_send):
            await _send(self, message)
            if message["type"] == "http.response.start":
                stamp("started")
            elif message["type"] == "http.response.body" and NON_EMPTY_CONTENT.search(message.get("body", b"")):
                stamp("content")

        cycle_class.send = stamped_send

    ProxyApp.__call__ = call

    read_body = relay.read_request_body

    async def read_request_body(request):
        raw = await read_body(request)
        stamp("body")
        return raw

    relay.read_request_body = read_request_body

    conns = upstream_http.UpstreamConnections
    write, request = conns._write, conns.request

    async def stamped_write(self, conn, head, body):
        await write(self, conn, head, body)
        stamp("sent")

    async def stamped_request(self, head, body):
        response = await request(self, head, body)
        stamp("head")
        return response

    conns._write, conns.request = stamped_write, stamped_request


def _cycle_classes() -> list:
    from uvicorn.protocols.http import h11_impl

    classes = [h11_impl.RequestResponseCycle]
    try:
        from uvicorn.protocols.http import httptools_impl
    except ImportError:
        return classes
    return [*classes, httptools_impl.RequestResponseCycle]


def run_stamped(out_path: str, argv: list[str]) -> None:
    sys.path.insert(0, (os.environ.get("PYTHONPATH") or str(ROOT)).split(os.pathsep)[0])
    install_stamps(out_path)
    from prefixtrace.cli import main as cli_main
    sys.argv = ["prefixtrace", *argv]
    cli_main()


def main() -> None:
    import httpx
    from bench_proxy_overhead import ROUTES, TINY_MODEL, stop

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--route", choices=sorted(ROUTES), default="chat")
    ap.add_argument("--baseline", metavar="TREE", default=None)
    ap.add_argument("--upstream-tree", metavar="TREE", default=None, help="the upstream's checkout (default: this)")
    ap.add_argument("--json", metavar="PATH", default=None, help="write the per-stage medians there")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="proxy_stages_") as tmp:
        tmp = Path(tmp)
        stamped = lambda name: ("--stamped", str(tmp / f"{name}.jsonl"))
        procs = []
        try:
            upstream, up_url = _start(["--model", str(TINY_MODEL), "--db", str(tmp / "up.db")], tmp,
                                      "up", stamped("up"),
                                      Path(args.upstream_tree).resolve() if args.upstream_tree else ROOT)
            procs.append(upstream)
            proxies = {}
            for name, tree in (("this", ROOT), ("baseline", Path(args.baseline).resolve() if args.baseline else None)):
                if tree is None:
                    continue
                proc, url = _start(["--upstream", up_url, "--db", str(tmp / f"{name}.db")], tmp, name,
                                   stamped(name), tree)
                procs.append(proc)
                proxies[name] = url
            # "direct": the same requests straight to the upstream, for the client's side of the path
            # (upstream content -> client reads it) without a proxy.
            clients = {name: httpx.Client(base_url=url, timeout=60)
                       for name, url in {**proxies, "direct": up_url}.items()}
            client_stamps = {}
            path, make_body, is_content = ROUTES[args.route]
            body = make_body(True, args.max_tokens)
            names = list(clients)
            for i in range(args.warmup + args.n):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    tag = f"{name}-{i}"
                    t0 = time.perf_counter_ns()
                    first = None
                    with clients[name].stream("POST", path, json=body, headers={"X-Stage-Id": tag}) as r:
                        for line in r.iter_lines():
                            if first is None and line.startswith("data:") and line[5:].strip() != "[DONE]" \
                                    and is_content(json.loads(line[5:])):
                                first = time.perf_counter_ns()
                    if i >= args.warmup:
                        client_stamps[tag] = (t0, first)
            for c in clients.values():
                c.close()
        finally:
            for proc in reversed(procs):
                stop(proc)
        up = {row["id"]: row for row in _rows(tmp / "up.jsonl")}
        results = {}
        for name in proxies:
            results[name] = _stages(_rows(tmp / f"{name}.jsonl"), up, client_stamps)
        direct = [(client_stamps[tag], up[tag]) for tag in client_stamps
                  if tag.startswith("direct-") and tag in up and "content" in up[tag] and client_stamps[tag][1]]
        for name in results:  # the direct requests' figures, beside each proxy's
            results[name]["wall direct: upstream content -> client reads it"] = statistics.median(
                (first - row["content"][0]) / 1e6 for (_, first), row in direct)
            results[name]["wall direct: client sent -> client reads first content"] = statistics.median(
                (first - sent) / 1e6 for (sent, first), _ in direct)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"median ms over n={args.n} streamed {args.route} turns each; load average after {load}")
    keys = list(next(iter(results.values())))
    print(f"{'stage':48s} " + " ".join(f"{name:>10s}" for name in results))
    for key in keys:
        print(f"{key:48s} " + " ".join(f"{results[name][key]:10.3f}" for name in results))
    if args.json:
        Path(args.json).write_text(json.dumps({"n": args.n, "route": args.route, "load_after": load,
                                               "stages_ms": results}, indent=1))


def _start(serve_args: list[str], tmp: Path, name: str, stamped: tuple[str, str], root: Path):
    """A `prefixtrace serve` from the tree at `root`, through this file's `--stamped` entry."""
    import subprocess

    import bench_proxy_overhead as bench

    log = tmp / f"{name}.log"
    port = bench.free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), *stamped, "--", "serve", "--port", str(port), *serve_args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), bench.INHERITED_PATH]))}
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return bench.wait_healthy(proc, f"http://127.0.0.1:{port}", " ".join(cmd), log)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _stages(rows: list[dict], upstream: dict, client: dict) -> dict:
    """Per-stage medians (ms) of one proxy's stamped requests."""
    cols: dict[str, list[float]] = {}

    def add(key, value_ns):
        cols.setdefault(key, []).append(value_ns / 1e6)

    for row in rows:
        tag = row.get("id")
        if tag not in client or not all(s in row for s in STAGES):
            continue
        t_send, t_first = client[tag]
        up = upstream.get(tag)
        for a, b in itertools.pairwise(STAGES):
            add(f"CPU  {a} -> {b}", row[b][1] - row[a][1])
            if (a, b) != ("sent", "head"):
                add(f"wall {a} -> {b}", row[b][0] - row[a][0])
        add("CPU  app -> content (the proxy's loop thread)", row["content"][1] - row["app"][1])
        add("wall client sent -> proxy app", row["app"][0] - t_send)
        if up is not None and "app" in up and "content" in up:
            add("wall proxy sent -> upstream app", up["app"][0] - row["sent"][0])
            add("wall upstream app -> upstream content", up["content"][0] - up["app"][0])
            if "started" in up:  # < 0: the upstream's head went out before its first content (prefill)
                add("wall upstream content -> its head written", up["started"][0] - up["content"][0])
            add("wall upstream content -> proxy content", row["content"][0] - up["content"][0])
        if t_first is not None:
            add("wall proxy content -> client reads it", t_first - row["content"][0])
            add("wall client sent -> client reads first content", t_first - t_send)
    return {key: statistics.median(values) for key, values in cols.items()}


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--stamped":
        run_stamped(sys.argv[2], sys.argv[4:])
    else:
        main()

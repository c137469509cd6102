"""What the proxy itself adds in `--upstream` mode (issue 17): TTFT and total time.

Starts two real `prefixtrace serve` processes on 127.0.0.1, each recording to its own
SQLite database (the recorder is on for both):

    upstream  prefixtrace serve --model fixtures/tiny-llama
    proxy     prefixtrace serve --upstream <upstream>

then sends the same short request alternately straight to the upstream and through
the proxy (after a warm-up), `--n` of each, with one keep-alive httpx client per
target, and prints p50/p90 of both and what the proxy adds, per route and mode:

    TTFT   request sent -> first content delta read (streamed requests)
    total  request sent -> end of the response ([DONE] / the last event / the whole body)

"added" is p50(proxied) - p50(direct); "paired" is the median of the per-pair
differences (one direct and one proxied request sent back to back), which is less
sensitive to drift on a loaded machine. "proxy CPU" is the CPU time the proxy process
used per proxied request (its threads' schedstat, ns; and in clock ticks, all threads), which load
does not blur. Goal (issue 17): added TTFT p50 <= 1 ms.

    python bench/bench_proxy_overhead.py                       # chat, messages, responses; 40 each
    python bench/bench_proxy_overhead.py --routes chat --n 100
    python bench/bench_proxy_overhead.py --proxy-http h11 --proxy-loop asyncio   # uvicorn's options, forced

`--server-cpus 0,1 --client-cpus 2,3` pins the servers (upstream, proxies, relay) and the client
apart (`taskset -c 0,1 python bench/...` puts everything on two cores, as issue 17 measured it).
`--relay` adds a third target, a bare TCP relay to the upstream (no HTTP, no work): what
one more local hop costs on this machine, the floor under any proxy's added latency.
`--otlp` starts an OTLP/HTTP receiver in the bench (testsupport/otlp_receiver.py) and the proxy with
`--otlp-endpoint` to it; with `--baseline .` the same tree runs beside it without the exporter, so
`serve --otlp-endpoint`'s cost is the proxied line against the baseline's (docs/OBSERVABILITY.md).
`--baseline TREE` adds a fourth: the same proxy run from another checkout (before a change),
interleaved with this one, so before/after is measured side by side under the same load.
`--upstream-tree TREE` runs the upstream from another checkout (its server code, not the proxy's).
`--baseline-path DIR` adds DIR to the baseline proxy's import path only (`--baseline . --baseline-path DIR`
with `pip install --target DIR uvloop httptools`: those measured without installing them for everything else).
The run ends with a summary line per case. `--proxy-http` / `--proxy-loop` start the proxy with those uvicorn options (through
`--serve-with`, below) so each can be measured against the default (auto: httptools
and uvloop when installed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testsupport import servers  # noqa: E402  (the health wait the tests use)

TINY_MODEL = ROOT / "fixtures" / "tiny-llama"
GOAL_MS = 1.0
# The servers keep the bench's own import path after their tree: packages installed with
# `pip install --target` (a GPU host with no registry) are found there too.
INHERITED_PATH = os.environ.get("PYTHONPATH")
PROMPT = "Say something short."

# route -> (path, body builder, test: is this SSE data line a content delta?)
ROUTES = {
    "chat": (
        "/v1/chat/completions",
        lambda stream, max_tokens: {"model": "default", "stream": stream, "max_tokens": max_tokens, "temperature": 0,
                                    "messages": [{"role": "user", "content": PROMPT}]},
        lambda obj: bool(obj.get("choices")) and bool((obj["choices"][0].get("delta") or {}).get("content")),
    ),
    "messages": (
        "/v1/messages",
        lambda stream, max_tokens: {"model": "default", "stream": stream, "max_tokens": max_tokens, "temperature": 0,
                                    "messages": [{"role": "user", "content": PROMPT}]},
        lambda obj: obj.get("type") == "content_block_delta" and bool((obj.get("delta") or {}).get("text")),
    ),
    "responses": (
        "/v1/responses",
        lambda stream, max_tokens: {"model": "default", "stream": stream, "max_output_tokens": max_tokens,
                                    "temperature": 0, "input": PROMPT},
        lambda obj: obj.get("type") == "response.output_text.delta" and bool(obj.get("delta")),
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_CPUS: set[int] | None = None  # --server-cpus: every server (and the relay) runs on these


def _pinned():
    if SERVER_CPUS is not None:
        os.sched_setaffinity(0, SERVER_CPUS)


def start_serve(args: list[str], cwd: Path, log: Path, serve_with: tuple[str, str] | None = None,
                root: Path = ROOT, extra_path: str | None = None):
    """`prefixtrace serve` from the tree at `root` (another checkout: `--baseline`), with
    `extra_path` after it on its import path (`--baseline-path`)."""
    port = free_port()
    prefix = [sys.executable, "-m", "prefixtrace.cli"]
    if serve_with is not None:
        prefix = [sys.executable, str(Path(__file__).resolve()), "--serve-with", *serve_with, "--"]
    proc = subprocess.Popen([*prefix, "serve", "--port", str(port), *args], cwd=cwd,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), extra_path,
                                                                                           INHERITED_PATH]))},
                            stdout=log.open("w"), stderr=subprocess.STDOUT,
                            preexec_fn=_pinned)  # noqa: PLW1509 (the bench starts no threads)
    return wait_healthy(proc, f"http://127.0.0.1:{port}", f"serve {' '.join(args)}", log)


def wait_healthy(proc, url: str, what: str, log: Path, timeout_s: float = 180):
    """(proc, url) once `url`/health answers 200; SystemExit with the server's log if it
    exits first or never does."""
    try:
        servers.wait_healthy(url, proc, what, timeout_s, log=log)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def one_request(client: httpx.Client, route: str, stream: bool, max_tokens: int) -> tuple[float | None, float]:
    """(ttft_s or None when not streamed, total_s) of one request, measured on the client."""
    path, body, is_content = ROUTES[route]
    payload = body(stream, max_tokens)
    t0 = time.perf_counter()
    if not stream:
        r = client.post(path, json=payload)
        r.read()
        total = time.perf_counter() - t0
        if r.status_code != 200:
            raise SystemExit(f"{route}: {r.status_code} {r.text[:500]}")
        return None, total
    ttft = None
    with client.stream("POST", path, json=payload) as r:
        if r.status_code != 200:
            raise SystemExit(f"{route}: {r.status_code} {r.read()[:500]!r}")
        for line in r.iter_lines():
            if ttft is None and line.startswith("data:"):
                data = line[5:].strip()
                if data != "[DONE]" and is_content(json.loads(data)):
                    ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    if ttft is None:
        raise SystemExit(f"{route}: the stream carried no content delta (max_tokens too small?)")
    return ttft, total


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process `pid` has used (all its threads, exited ones too),
    from /proc, in clock ticks (10 ms: over 40 requests, a 0.25 ms step per request)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_fine_s(pid: int) -> float:
    """The same in nanoseconds, from each live thread's /proc/PID/task/TID/schedstat (its time on a
    CPU); a thread that has exited is not counted (the proxy's threads live as long as it does)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return total / 1e9


def measure(clients: dict[str, httpx.Client], route: str, stream: bool, n: int, warmup: int,
            max_tokens: int, pids: dict[str, int]) -> dict:
    """`clients`: "direct" first, then "proxied" and optionally "relay" and "baseline"; each
    sample round sends one request to each, in a rotating order so that none always follows
    another. `pids`: the proxy processes whose CPU is counted, by side."""
    sides = list(clients)
    for _ in range(warmup):
        for side in sides:
            one_request(clients[side], route, stream, max_tokens)
    samples = {side: [] for side in sides}
    cpu = {side: 0.0 for side in pids}
    fine = {side: 0.0 for side in pids}
    for i in range(n):
        order = sides[i % len(sides):] + sides[:i % len(sides)]
        for side in order:
            if side in pids:
                cpu0, fine0 = cpu_s(pids[side]), cpu_fine_s(pids[side])
            samples[side].append(one_request(clients[side], route, stream, max_tokens))
            if side in pids:
                cpu[side] += cpu_s(pids[side]) - cpu0
                fine[side] += cpu_fine_s(pids[side]) - fine0
    # A proxy's own CPU per request (event loop and recorder thread): on a loaded machine
    # latency is noisy, the work it takes much less so.
    out = {"cpu_ms": {side: t * 1000 / n for side, t in cpu.items()},
           "cpu_fine_ms": {side: t * 1000 / n for side, t in fine.items()}}
    for metric, idx in (("ttft", 0), ("total", 1)):
        if metric == "ttft" and not stream:
            continue
        d = [s[idx] * 1000 for s in samples["direct"]]
        out[metric] = {"direct_p50": pct(d, 0.5), "direct_p90": pct(d, 0.9)}
        for side in sides[1:]:
            p = [s[idx] * 1000 for s in samples[side]]
            out[metric][side] = {"p50": pct(p, 0.5), "p90": pct(p, 0.9), "added_p50": pct(p, 0.5) - pct(d, 0.5),
                                 "paired_p50": statistics.median(b - a for a, b in zip(d, p))}
    return out


def relay(port: int, upstream_port: int) -> None:
    """A bare TCP relay (bytes both ways, no HTTP): what one more local hop costs on this
    machine with no work done in it, the floor under any proxy's added latency."""
    import asyncio

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def handle(client_r, client_w):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w), return_exceptions=True)

    async def serve():
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40, help="requests each way per case (default 40)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--routes", default="chat,messages,responses")
    ap.add_argument("--modes", default="stream,whole")
    ap.add_argument("--proxy-http", default=None, help="force uvicorn's --http for the proxy (h11, httptools)")
    ap.add_argument("--proxy-loop", default=None, help="force uvicorn's --loop for the proxy (asyncio, uvloop)")
    ap.add_argument("--relay", action="store_true",
                    help="also measure through a bare TCP relay: the cost of one more hop, doing nothing")
    ap.add_argument("--baseline", metavar="TREE", default=None,
                    help="also measure a second proxy run from another checkout (e.g. `git archive main`), "
                         "interleaved with this one")
    ap.add_argument("--baseline-uvicorn", metavar="HTTP,LOOP", default=None,
                    help="uvicorn's http and loop for the baseline proxy (e.g. h11,asyncio): with --baseline "
                         "set to this tree, measures those options against the default")
    ap.add_argument("--baseline-path", metavar="DIR", default=None,
                    help="an extra import path for the baseline proxy only, e.g. a `pip install --target DIR "
                         "uvloop httptools` (measures those without installing them for everything else)")
    ap.add_argument("--upstream-tree", metavar="TREE", default=None,
                    help="run the upstream engine from another checkout (default: this one): e.g. main's, to "
                         "tell what a change to the server (proxy/connections.py) does for the upstream "
                         "from what it does for the proxy")
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    ap.add_argument("--otlp", action="store_true",
                    help="the proxy exports a span per turn to an OTLP receiver in the bench (--otlp-endpoint); "
                         "with --baseline . the baseline does not")
    ap.add_argument("--server-cpus", metavar="0,1", default=None,
                    help="run the upstream, the proxies and the relay on these CPUs only (Linux)")
    ap.add_argument("--client-cpus", metavar="2,3", default=None,
                    help="run this process (the client) on these CPUs only (Linux)")
    args = ap.parse_args()
    global SERVER_CPUS
    if args.server_cpus:
        SERVER_CPUS = {int(c) for c in args.server_cpus.split(",")}
    if args.client_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})

    serve_with = None
    if args.proxy_http or args.proxy_loop:
        serve_with = (args.proxy_http or "auto", args.proxy_loop or "auto")
    baseline_with = serve_with
    if args.baseline_uvicorn:
        baseline_with = tuple(args.baseline_uvicorn.split(","))
    results = {}
    receiver = None
    proxy_extra: list[str] = []
    if args.otlp:
        sys.path.insert(0, str(ROOT))
        from testsupport.otlp_receiver import OtlpReceiver

        receiver = OtlpReceiver().__enter__()
        proxy_extra = ["--otlp-endpoint", receiver.url]
    with tempfile.TemporaryDirectory(prefix="bench_proxy_") as tmp:
        tmp = Path(tmp)
        (tmp / "up").mkdir()
        (tmp / "px").mkdir()
        upstream, up_url = start_serve(["--model", str(TINY_MODEL), "--db", str(tmp / "up" / "up.db")],
                                       tmp / "up", tmp / "up.log",
                                       root=Path(args.upstream_tree).resolve() if args.upstream_tree else ROOT)
        try:
            proxy, px_url = start_serve(["--upstream", up_url, "--db", str(tmp / "px" / "px.db"), *proxy_extra],
                                        tmp / "px", tmp / "px.log", serve_with)
            try:
                print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; servers on CPUs "
                      f"{sorted(SERVER_CPUS) if SERVER_CPUS else 'any'}, client on {sorted(os.sched_getaffinity(0))}")
                print(f"upstream {up_url} (pid {upstream.pid}, from {args.upstream_tree or 'this tree'}), "
                      f"proxy {px_url} (pid {proxy.pid}), "
                      f"proxy uvicorn http={serve_with[0] if serve_with else 'auto'} "
                      f"loop={serve_with[1] if serve_with else 'auto'}; n={args.n} each, max_tokens={args.max_tokens}")
                clients = {"direct": httpx.Client(base_url=up_url, timeout=60),
                           "proxied": httpx.Client(base_url=px_url, timeout=60)}
                pids = {"proxied": proxy.pid}
                relay_proc = baseline = None
                if args.baseline:
                    (tmp / "bl").mkdir()
                    baseline, bl_url = start_serve(["--upstream", up_url, "--db", str(tmp / "bl" / "bl.db")],
                                                   tmp / "bl", tmp / "bl.log", baseline_with, root=Path(args.baseline).resolve(),
                                                   extra_path=args.baseline_path)
                    clients["baseline"] = httpx.Client(base_url=bl_url, timeout=60)
                    pids["baseline"] = baseline.pid
                    print(f"baseline proxy {bl_url} (pid {baseline.pid}) from {args.baseline}, uvicorn "
                          f"http,loop={','.join(baseline_with) if baseline_with else 'auto'}"
                          + (f", import path + {args.baseline_path}" if args.baseline_path else ""))
                if args.relay:
                    relay_port = free_port()
                    relay_proc = subprocess.Popen([sys.executable, __file__, "--run-relay", str(relay_port),
                                                   up_url.rsplit(":", 1)[1]],
                                                  preexec_fn=_pinned)  # noqa: PLW1509
                    for _ in range(300):  # until it listens
                        try:
                            socket.create_connection(("127.0.0.1", relay_port), timeout=1).close()
                            break
                        except OSError:
                            time.sleep(0.1)
                    clients["relay"] = httpx.Client(base_url=f"http://127.0.0.1:{relay_port}", timeout=60)
                try:
                    for route in args.routes.split(","):
                        for mode in args.modes.split(","):
                            res = measure(clients, route, mode == "stream", args.n, args.warmup,
                                          args.max_tokens, pids)
                            results[f"{route}/{mode}"] = res
                            report(route, mode, res)
                finally:
                    for client in clients.values():
                        client.close()
                    if relay_proc is not None:
                        relay_proc.kill()
                        relay_proc.wait()
                    if baseline is not None:
                        stop(baseline)
            finally:
                stop(proxy)
        finally:
            stop(upstream)
    summary(results)
    if receiver is not None:
        print(f"OTLP receiver: {len(receiver.spans)} span(s) in {receiver.requests} export request(s)")
        receiver.__exit__(None, None, None)
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        print(json.dumps(results))


def summary(results: dict) -> None:
    """One line per case: what each side adds to the first content (streamed) or to the whole
    response (whole), p50 and paired, and the proxies' CPU per request."""
    print("\nsummary (ms; added p50 / paired p50 over direct; TTFT for streamed, total for whole)")
    for case, res in results.items():
        metric = "ttft" if "ttft" in res else "total"
        r = res[metric]
        cells = [f"{case:18s} {metric:5s} direct {r['direct_p50']:7.2f}"]
        for side in ("relay", "baseline", "proxied"):
            if side in r:
                cells.append(f"{side} {r[side]['added_p50']:+6.2f} / {r[side]['paired_p50']:+6.2f}")
        cells.append("CPU " + ", ".join(f"{side} {ms:.3f}" for side, ms in res["cpu_fine_ms"].items()))
        print(" | ".join(cells))


def report(route: str, mode: str, res: dict) -> None:
    for metric, r in res.items():
        if metric in ("cpu_ms", "cpu_fine_ms"):
            continue
        line = f"{route:9s} {mode:6s} {metric:5s}  direct p50 {r['direct_p50']:7.2f} p90 {r['direct_p90']:7.2f}"
        for side in ("relay", "baseline", "proxied"):
            if side in r:
                x = r[side]
                verdict = ""
                if metric == "ttft" and side == "proxied":
                    verdict = "  OK" if x["added_p50"] <= GOAL_MS else f"  (goal <= {GOAL_MS:.0f} ms)"
                line += (f" | {side} p50 {x['p50']:7.2f} p90 {x['p90']:7.2f} added {x['added_p50']:+6.2f}"
                         f" paired {x['paired_p50']:+6.2f}{verdict}")
        print(line + "  (ms)", flush=True)
    print(f"{route:9s} {mode:6s} proxy CPU per request (schedstat, live threads): "
          + ", ".join(f"{side} {ms:.3f} ms" for side, ms in res["cpu_fine_ms"].items())
          + "; in clock ticks, all threads: "
          + ", ".join(f"{side} {ms:.2f} ms" for side, ms in res["cpu_ms"].items()), flush=True)


def serve_with(http: str, loop: str, argv: list[str]) -> None:
    """Run `prefixtrace <argv>` with uvicorn's `http` and `loop` options forced (bench only)."""
    # The tree start_serve put first on PYTHONPATH (a --baseline checkout), else this one.
    sys.path.insert(0, (os.environ.get("PYTHONPATH") or str(ROOT)).split(os.pathsep)[0])
    import uvicorn

    original = uvicorn.Config.__init__

    def init(self, *a, **kw):
        kw["http"], kw["loop"] = http, loop
        original(self, *a, **kw)

    uvicorn.Config.__init__ = init
    from prefixtrace.cli import main as cli_main
    sys.argv = ["prefixtrace", *argv]
    cli_main()


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--run-relay":
        relay(int(sys.argv[2]), int(sys.argv[3]))
    elif len(sys.argv) > 3 and sys.argv[1] == "--serve-with":
        serve_with(sys.argv[2], sys.argv[3], sys.argv[5:])
    else:
        main()

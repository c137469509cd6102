"""Big streamed replies through the proxy in `--upstream` mode (issue 25, finding 8).

A scripted upstream on 127.0.0.1 (a process of its own: this file with `--upstream-only`)
answers every chat-completions POST with one prebuilt SSE stream, as fast as the socket
takes it; a real `prefixtrace serve --upstream` process (recorder on) sits in front of it.
Each case is read whole by a plain socket client, alternately straight from the upstream and
through the proxy (`--repeat` of each; with `--baseline TREE` also through a second proxy run from
another checkout, interleaved), and the medians are printed side by side with their ratio and the
proxy process's CPU time per request (all its threads, the recorder's commit included), which the
machine's load does not blur:

    big    a reply of `--mb` MB of content (20) in `--piece`-character deltas (1000)
    tiny   `--tiny-mb` MB (4) of 10-byte events (`data: {}` and a blank line), then the reply's end

Goal: each under 2 s through the proxy. Before the change it was quadratic on the event loop:
`turn.response_text += piece` per chunk and an SSE splitter that copied its buffer per event
(a 20 MB reply: 165 s; 4 MB of tiny events: 31 s).

    python bench/bench_upstream_stream.py
    python bench/bench_upstream_stream.py --mb 5 --piece 100 --repeat 3
    git archive <before> | tar -x -C /tmp/before && python bench/bench_upstream_stream.py --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_proxy_overhead import stop  # noqa: E402  (SIGINT, then kill: the same stop for every served tree)

ROOT = Path(__file__).resolve().parent.parent
GOAL_S = 2.0


def chunk(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    return b"data: " + json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).encode() + b"\n\n"


END = (chunk(None, "stop") + b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
       b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}\n\n' + b"data: [DONE]\n\n")


def stream_for(case: str, mb: float, piece: int, tiny_mb: float) -> bytes:
    if case == "big":
        n = int(mb * 1e6) // piece
        return chunk("x" * piece) * n + END
    return b"data: {}\n\n" * int(tiny_mb * 1e6 / 10) + END


# --- the scripted upstream (its own process) ---------------------------------------------------


def run_upstream(port: int, streams: dict[str, bytes]) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                if head.startswith(b"GET"):
                    data = b'{"object":"list","data":[]}'
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(data), data))
                    await writer.drain()
                    continue
                stream = streams[json.loads(body)["model"]]
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                view = memoryview(stream)
                for i in range(0, len(stream), 65536):
                    piece = view[i:i + 65536]
                    writer.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
                await writer.drain()
                if b"connection: close" in head.lower():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# --- the client ------------------------------------------------------------------------------


def read_one(url: str, model: str) -> tuple[float, int]:
    """(seconds from sending the request to the response's last byte, bytes read), on a plain socket."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s:%s\r\ncontent-type: application/json\r\n"
               b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (host.encode(), port.encode(), len(body), body))
    with socket.create_connection((host, int(port))) as sock:
        t0 = time.perf_counter()
        sock.sendall(request)
        total = 0
        tail = b""
        buf = bytearray(1 << 20)
        while True:
            n = sock.recv_into(buf)
            if not n:
                break
            total += n
            tail = (tail + bytes(buf[:n]))[-64:]
        elapsed = time.perf_counter() - t0
    if b"[DONE]" not in tail:
        raise SystemExit(f"{url}: the stream did not end with [DONE]: {tail!r}")
    return elapsed, total


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used: what load does not blur."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    host, port = url.removeprefix("http://").split(":")
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited early:\n{log.read_text()}")
        try:
            with socket.create_connection((host, int(port)), timeout=1) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
                if sock.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{url} did not start:\n{log.read_text()}")
        time.sleep(0.2)




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=20.0, help="MB of content in the big reply")
    parser.add_argument("--piece", type=int, default=1000, help="characters per content delta in the big reply")
    parser.add_argument("--tiny-mb", type=float, default=4.0, help="MB of 10-byte events in the tiny case")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case, direct and proxied")
    parser.add_argument("--proxy-tree", type=Path, default=ROOT,
                        help="run the proxy from this checkout (another tree: the code before a change)")
    parser.add_argument("--baseline", type=Path, metavar="TREE",
                        help="a second proxy from this checkout (before a change), read interleaved with the first")
    parser.add_argument("--cases", default="big,tiny", help="comma-separated: big, tiny")
    parser.add_argument("--proxy-prefix", default="", help=argparse.SUPPRESS)  # e.g. "-m cProfile -o FILE"
    parser.add_argument("--upstream-only", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    streams = {case: stream_for(case, args.mb, args.piece, args.tiny_mb) for case in ("big", "tiny")}
    if args.upstream_only:
        run_upstream(args.upstream_only, streams)
        return

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    trees = {"proxy": args.proxy_tree}
    if args.baseline is not None:
        trees["baseline"] = args.baseline
    with tempfile.TemporaryDirectory() as tmp:
        up_port = free_port()
        upstream_url = f"http://127.0.0.1:{up_port}"
        up_log = Path(tmp) / "upstream.log"
        argv = [sys.executable, __file__, "--mb", str(args.mb), "--piece", str(args.piece),
                "--tiny-mb", str(args.tiny_mb), "--upstream-only", str(up_port)]
        upstream = subprocess.Popen(argv, env=env, stdout=up_log.open("w"), stderr=subprocess.STDOUT)
        proxies = {}  # name -> (proc, url, log)
        try:
            for name, tree in trees.items():
                port = free_port()
                log = Path(tmp) / f"{name}.log"
                tree_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree.resolve()),
                                                                                      os.environ.get("PYTHONPATH")]))}
                proc = subprocess.Popen([sys.executable, *args.proxy_prefix.split(), "-m", "prefixtrace.cli", "serve",
                                         "--port", str(port), "--upstream", upstream_url,
                                         "--db", str(Path(tmp) / f"{name}.db"), "--log-level", "warning"],
                                        cwd=tmp, env=tree_env, stdout=log.open("w"), stderr=subprocess.STDOUT)
                proxies[name] = (proc, f"http://127.0.0.1:{port}", log)
            wait_listening(upstream_url, upstream, up_log)
            for proc, url, log in proxies.values():
                wait_listening(url, proc, log)
            results = {}
            for case in args.cases.split(","):
                times: dict[str, list[float]] = {"direct": [], **{name: [] for name in proxies}}
                cpu: dict[str, list[float]] = {name: [] for name in proxies}
                for _ in range(args.repeat):  # interleaved: the same load for each target
                    times["direct"].append(read_one(upstream_url, case)[0])
                    for name, (proc, url, _) in proxies.items():
                        before = cpu_s(proc.pid)
                        times[name].append(read_one(url, case)[0])
                        time.sleep(0.5)  # the turn's commit (the recorder's thread) is the proxy's work too
                        cpu[name].append(cpu_s(proc.pid) - before)
                direct = statistics.median(times["direct"])
                row = {"stream_bytes": len(streams[case]), "events": streams[case].count(b"\n\n"),
                       "direct_s": round(direct, 3)}
                line = [f"{case:5s} {len(streams[case]) / 1e6:6.1f} MB of SSE, {row['events']} events: "
                        f"direct {direct:.3f} s"]
                for name in proxies:
                    proxied = statistics.median(times[name])
                    row[name] = {"s": round(proxied, 3), "ratio": round(proxied / direct, 1),
                                 "runs_s": [round(t, 3) for t in times[name]],
                                 "cpu_s": round(statistics.median(cpu[name]), 2), "goal_met": proxied < GOAL_S}
                    line.append(f"{name} {proxied:.3f} s (x{proxied / direct:.1f}; its CPU "
                                f"{row[name]['cpu_s']:.2f} s; goal < {GOAL_S:g} s {'met' if proxied < GOAL_S else 'NOT met'})")
                results[case] = row
                print(", ".join(line), flush=True)
            print(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "load_average": os.getloadavg(),
                              "cpus": os.cpu_count(), "mb": args.mb, "piece": args.piece, "tiny_mb": args.tiny_mb,
                              "repeat": args.repeat, "results": results}))
        finally:
            for proc, _, _ in proxies.values():
                stop(proc)
            upstream.kill()
            upstream.wait()


if __name__ == "__main__":
    main()

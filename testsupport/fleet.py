"""A fleet on loopback (docs/FLEET.md): `prefixtrace serve` workers on the tiny model, a real router from
PyPI (sglang-router, vllm-router) in front of them, and a prefixtrace proxy in front of that."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from testsupport.servers import ROOT, TINY_MODEL, free_port, running_server, stop, wait_healthy


@contextmanager
def workers(count: int, tmp: Path, *, block_size: int = 16, model: Path = TINY_MODEL):
    """`count` `prefixtrace serve` workers on the tiny model, each on its own port and database,
    named w1, w2, ...; yields [(url, name, proc)] once all answer /health."""
    started = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        for i in range(1, count + 1):
            port, name = free_port(), f"w{i}"
            proc = subprocess.Popen(
                [sys.executable, "-m", "prefixtrace.cli", "serve", "--port", str(port), "--model", str(model),
                 "--db", str(tmp / f"{name}.db"), "--worker-name", name, "--block-size", str(block_size),
                 "--log-level", "warning"],
                cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            started.append((f"http://127.0.0.1:{port}", name, proc))
        for url, name, proc in started:
            wait_healthy(url, proc, f"worker {name}")
        yield started
    finally:
        for _, _, proc in started:
            stop(proc)


ROUTERS = {"sglang": "sglang_router.launch_router", "vllm": "vllm_router.launch_router"}


def router_available(kind: str) -> str | None:
    """None when `kind`'s router can run here, else why not."""
    import importlib.util

    if importlib.util.find_spec(kind + "_router") is None:
        return f"{kind}-router is not installed (pip install {kind}-router)"
    return None


@contextmanager
def router(kind: str, policy: str, worker_urls: list[str], *extra: str):
    """sglang-router or vllm-router on a free loopback port in front of `worker_urls`; yields its URL."""
    port, metrics = free_port(), free_port()
    args = [sys.executable, "-m", ROUTERS[kind], "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
            "--log-level", "warn" if kind == "sglang" else "warning", *extra]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, f"{kind}-router", timeout=60)
        # Drain its log so a chatty router never blocks on a full pipe.
        threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()
        yield url, proc
    finally:
        stop(proc)


@contextmanager
def front_proxy(upstreams: list[str], db: Path):
    """A prefixtrace proxy (real uvicorn on loopback, in this process) forwarding to `upstreams`:
    one (a router) or several (its own affinity pool). Yields (url, recorder)."""
    from proxy.app import create_app
    from proxy.upstream_backend import UpstreamBackend
    from proxy.upstream_pool import UpstreamPool
    from recorder.store import Recorder

    backend = UpstreamBackend(upstreams[0] + "/v1") if len(upstreams) == 1 else \
        UpstreamPool([u + "/v1" for u in upstreams])
    with Recorder(db) as rec, running_server(create_app(backend, rec)) as url:
        yield url, rec

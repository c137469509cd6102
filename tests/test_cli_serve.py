"""`prefixtrace serve` as a user runs it: a subprocess, from another working directory."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, TINY_MODEL, free_port


@contextmanager
def serve_process(args: list[str], cwd: Path, env: dict | None = None, ready_timeout: float = 120):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixtrace.cli", "serve", "--port", str(port), *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"serve exited early:\n{proc.stdout.read()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("serve did not become healthy")
            time.sleep(0.2)
        yield url, proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_serve_records_a_turn_in_the_working_directory(tmp_path):
    with serve_process(["--model", str(TINY_MODEL)], cwd=tmp_path) as (url, proc):
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    output = proc.stdout.read()
    db = tmp_path / "prefixtrace.db"
    assert db.exists(), output
    con = sqlite3.connect(db)
    assert con.execute("select count(*), max(status) from turns").fetchone() == (1, 200)


@pytest.mark.slow
def test_serve_binds_loopback_by_default(tmp_path):
    with serve_process(["--model", str(TINY_MODEL)], cwd=tmp_path) as (url, _):
        assert url.startswith("http://127.0.0.1:")
        # nothing listens on the machine's other addresses
        import socket

        hostname_ip = socket.gethostbyname(socket.gethostname())
        if hostname_ip.startswith("127."):
            pytest.skip("no non-loopback address to probe")
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://{hostname_ip}:{port}/health", timeout=2)


@pytest.mark.slow
def test_serve_with_no_model_converts_and_serves_the_bundled_default(tmp_path):
    """The README's main job: `prefixtrace serve` on the bundled SmolLM2, converted on first use."""
    env = {"PREFIXTRACE_CACHE_DIR": str(tmp_path / "cache")}
    with serve_process([], cwd=tmp_path, env=env, ready_timeout=300) as (url, proc):
        models = httpx.get(url + "/v1/models").json()
        assert {"smollm2-135m-instruct", "default"} <= {m["id"] for m in models["data"]}
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "default", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200
        assert "Paris" in r.json()["choices"][0]["message"]["content"]
    assert any((tmp_path / "cache").rglob("config.json"))  # converted into the cache dir, once


def test_kv_dense_layers_parse_from_the_command_line():
    from click.testing import CliRunner

    from prefixtrace.cli import cli

    for given, expected in (("0,-1", [0, -1]), ("none", []), ("-1", [-1])):
        out = CliRunner().invoke(cli, ["serve", "--print-config", "--kv-dense-layers", given])
        assert out.exit_code == 0, out.output
        assert json.loads(out.output)["options"]["kv_dense_layers"]["value"] == expected
    bad = CliRunner().invoke(cli, ["serve", "--print-config", "--kv-dense-layers", "last"])
    assert bad.exit_code != 0 and "layer indices" in bad.output


def _tour_blocks() -> tuple[str, str]:
    """The README's tour: its Python block and the shell block after it, as written."""
    import re

    readme = (ROOT / "README.md").read_text()
    tour = readme[readme.index("## A 30-second tour"):]
    tour = tour[:tour.index("\n## ", 3)]
    python = re.search(r"```python\n(.*?)```", tour, re.S).group(1)
    shell = re.search(r"```bash\n(.*?)```", tour, re.S).group(1)
    return python, shell


@pytest.mark.slow
def test_the_readme_tour_works_as_written(tmp_path):
    """Issue 26: the tour needed `openai` it never installed and named a file it never made.
    Run with the bundled model, its port swapped for a free one, from a fresh directory."""
    python, shell = _tour_blocks()
    with serve_process([], cwd=tmp_path, ready_timeout=300) as (url, proc):
        port = url.rsplit(":", 1)[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", python.replace("8765", port)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        first, second = (int(n) for n in done.stdout.split())
        assert first == 0 and second > 0, done.stdout
        for line in shell.strip().splitlines():
            command = line.split("  #")[0].strip().replace("8765", port)
            ran = subprocess.run(["bash", "-c", command.replace("prefixtrace ", f"{sys.executable} -m prefixtrace.cli ")],
                                 cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
            assert ran.returncode == 0, f"{command}\n{ran.stdout}\n{ran.stderr}"
    assert (tmp_path / "copy.db").exists() and (tmp_path / "traffic.jsonl").exists()

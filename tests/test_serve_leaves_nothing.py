"""A stopped `serve` leaves nothing of its own behind in the temp dir (issue 36): no spill directory,
no tiktoken cache, whether it is stopped by SIGTERM (a service manager, `kill`) or Ctrl-C; and on
SIGTERM it closes the recorder as on Ctrl-C (uvicorn re-raised the signal with the default handler,
which ended the process before the `finally` blocks ran).

MLX's CPU backend keeps the kernels it compiles in `$TMPDIR/mlx/<version>/cpu/`, a cache MLX itself
reuses across processes: it is MLX's, one directory however many times serve starts, and allowed."""

from __future__ import annotations

import signal
import sqlite3

import httpx
import pytest

from testsupport.servers import start_serve

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_a_stopped_serve_leaves_an_empty_temp_dir(tmp_path, monkeypatch, sig):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setenv("PREFIXTRACE_CACHE_DIR", str(tmp_path / "cache"))
    proc, url = start_serve(tmp_path / "t.db", tmp_path / "serve.log")
    try:
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        httpx.get(url + "/ui/api/sessions", timeout=30)  # the dashboard's analysis (tiktoken's cache) ran too
    finally:
        proc.send_signal(sig)
        proc.wait(60)
    assert proc.returncode == 0, (tmp_path / "serve.log").read_text()[-2000:]
    assert sorted(p.name for p in tmp.iterdir() if p.name != "mlx") == []
    with sqlite3.connect(tmp_path / "t.db") as db:
        assert db.execute("select count(*) from turns").fetchone()[0] == 1

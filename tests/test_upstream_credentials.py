"""Issue 14, finding 2: `--upstream http://user:pass@host` uses the credentials and shows them nowhere.

A real upstream (the embedded tiny engine behind a Basic-auth check) and `prefixtrace serve`
as a subprocess in front of it, with a second, dead upstream so the pool's health checks log
every 2 s; then every surface the probe read: client responses (a 502 too), /health,
/v1/capacity, /v1/models, /metrics, /ui, the log, the database file, JSONL and HAR exports.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time

import httpx
import pytest
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from prefixtrace.common.urls import credentials, display_url, without_credentials
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from tests.conftest import ROOT, free_port, running_server
from tests.test_cli_serve import serve_process

USER, PASSWORD = "alice", "hunter2@xyzzy-7f3a"
ENCODED = "hunter2%40xyzzy-7f3a"  # as it is written in a URL
SECRETS = (PASSWORD, ENCODED, "xyzzy-7f3a", base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode())


def basic_auth_required(app):
    """The upstream refuses every request without the right credentials (401)."""
    expected = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and Headers(scope=scope).get("authorization") != expected:
            return await JSONResponse({"error": {"message": "bad credentials"}}, status_code=401)(scope, receive, send)
        await app(scope, receive, send)

    return guarded


def assert_no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} in {where}"


def test_display_url_hides_userinfo_and_keeps_the_rest():
    url = f"http://{USER}:{ENCODED}@10.0.0.5:8000/v1"
    assert display_url(url) == "http://***@10.0.0.5:8000/v1"
    assert display_url("http://10.0.0.5:8000") == "http://10.0.0.5:8000"
    assert display_url("https://token@host") == "https://***@host"
    assert without_credentials(url) == "http://10.0.0.5:8000/v1"
    assert credentials(url) == (USER, PASSWORD) and credentials("http://h:1") is None


@pytest.mark.slow
def test_upstream_credentials_are_used_but_never_shown_logged_stored_or_exported(tiny_engine, recorder, tmp_path):
    upstream_server = running_server(basic_auth_required(create_app(EngineBackend(tiny_engine), recorder)))
    upstream = upstream_server.__enter__()
    live = upstream.replace("http://", f"http://{USER}:{ENCODED}@")
    dead = f"http://{USER}:{ENCODED}@127.0.0.1:{free_port()}"
    db = tmp_path / "front.db"
    seen: dict[str, str] = {}
    try:
        with serve_process(["--upstream", live, "--upstream", dead, "--db", str(db)], cwd=tmp_path) as (url, proc):
            chat = httpx.post(url + "/v1/chat/completions", timeout=120, headers={"X-Session-Id": "s1"},
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert chat.status_code == 200, chat.text  # the credentials reached the upstream
            seen["chat"] = chat.text
            for path in ("/health", "/v1/capacity", "/v1/models", "/metrics", "/ui", "/ui/api/sessions"):
                r = httpx.get(url + path, timeout=60)
                assert r.status_code == 200, (path, r.text)
                seen[path] = r.text
            assert "http://***@127.0.0.1" in seen["/health"] and "http://***@127.0.0.1" in seen["/metrics"]
            upstream_server.__exit__(None, None, None)
            upstream_server = None
            down = httpx.post(url + "/v1/chat/completions", timeout=120, headers={"X-Session-Id": "s2"},
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert down.status_code == 502 and "***@127.0.0.1" in down.text, down.text
            seen["502"] = down.text
            time.sleep(4.5)  # two more rounds of health checks, each one logged
        log = proc.stdout.read()
    finally:
        if upstream_server is not None:
            upstream_server.__exit__(None, None, None)
    assert "HTTP Request: GET http://127.0.0.1:" in log  # the health checks were logged...
    assert_no_secret(log, "the log")  # ...without the credentials
    for where, text in seen.items():
        assert_no_secret(text, where)
    assert_no_secret(db.read_bytes().decode("latin-1"), "the database")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for fmt in ("jsonl", "har"):
        out = tmp_path / f"export.{fmt}"
        subprocess.run([sys.executable, "-m", "prefixtrace.cli", "export", str(db), "--format", fmt, "--out",
                        str(out)], check=True, env=env, cwd=tmp_path, capture_output=True, timeout=120)
        assert "***@127.0.0.1" in out.read_text()
        assert_no_secret(out.read_text(), fmt)
    shown = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "serve", "--upstream", live, "--print-config"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "***@127.0.0.1" in shown.stdout
    assert_no_secret(shown.stdout + shown.stderr, "--print-config")


def test_replay_target_credentials_are_used_but_not_reported(tiny_engine, recorder, tmp_path):
    import json

    with running_server(create_app(EngineBackend(tiny_engine), recorder)) as plain:
        r = httpx.post(plain + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 2})
        assert r.status_code == 200
    recorder.flush()
    with running_server(basic_auth_required(create_app(EngineBackend(tiny_engine), recorder))) as upstream:
        target = upstream.replace("http://", f"http://{USER}:{ENCODED}@")
        out = tmp_path / "replay.json"
        done = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "replay", str(recorder.path), "--target",
                               target, "--out", str(out)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["targets"][0]["turns"][0]["status"] == 200  # authenticated
    assert report["targets"][0]["url"].startswith("http://***@127.0.0.1")
    assert_no_secret(out.read_text() + done.stdout + done.stderr, "the replay report")

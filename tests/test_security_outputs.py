"""Issue 14, finding 3: every output a person opens escapes what came from clients, and a
web page on another origin cannot drive the proxy.

Driven as the probe drove it: hostile requests through a real server on 127.0.0.1 (some
refused with a 400, and recorded all the same), then the CLI's reports, opened in a real
headless Chromium where they are pages, and read as bytes where they go to a terminal.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import pytest

from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from proxy.guard import RequestGuard
from tests.conftest import ROOT, free_port, rows, running_server

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]
EVIL_ROLE = "<script>document.title='pwned';window.pwned=1</script><img src=x onerror=\"window.pwned=2\">"
EVIL_SESSION = "s\"><script>window.pwnedSession=1</script></script>&amp;"
ESCAPES = "\x1b]0;retitled\x07\x1b[2J\x1b[31m\x9b31m\u202e"  # OSC title, clear screen, colour, 8-bit CSI, bidi


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], capture_output=True, timeout=300,
                          env=env, cwd=ROOT)


def _post(url: str, body: dict, session: str, path: str = "/v1/chat/completions") -> httpx.Response:
    # Header bytes as sent (UTF-8); the server reads them as Latin-1, escapes and all.
    return httpx.post(url + path, json=body, timeout=120, headers={"X-Session-Id": session.encode()})


def _plant(url: str, role: str, session: str) -> None:
    """Two turns of one session: the first names a role the engine refuses (a recorded 400, so the
    planted text is in the database), the second is an ordinary turn of the same session."""
    head = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    first = _post(url, {"messages": [*head, {"role": role, "content": "c"}], "max_tokens": 2}, session)
    assert first.status_code == 400
    second = _post(url, {"messages": [*head, {"role": "user", "content": "d"}], "max_tokens": 2,
                         "temperature": 0}, session)
    assert second.status_code == 200, second.text


@pytest.fixture
def browser():
    if not CHROMIUM.exists():
        pytest.skip("chromium is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=[*FLAGS, "--host-resolver-rules=MAP rebind.test 127.0.0.1"])
        yield browser
        browser.close()


# --- HTML reports in a real browser -------------------------------------------------


def _role_blind_upstream():
    """An OpenAI-compatible upstream that takes any role, as a server rendering with a ChatML
    template does (`<|im_start|>{{ role }}`); it answers every chat with one short reply."""
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "any", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat():
        return {"id": "c1", "object": "chat.completion", "created": 0, "model": "any",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}

    return app


def test_analyze_html_does_not_run_a_role_planted_through_an_upstream(recorder, browser, tmp_path):
    from proxy.upstream_backend import UpstreamBackend

    head = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    with running_server(_role_blind_upstream()) as upstream, \
            running_server(create_app(UpstreamBackend(upstream), recorder)) as url:
        for tail in ({"role": EVIL_ROLE, "content": "c"}, {"role": "user", "content": "d"}):
            r = _post(url, {"messages": [*head, tail], "max_tokens": 2}, "agent")
            assert r.status_code == 200, r.text
    recorder.flush()
    out = tmp_path / "report.html"
    done = _cli("analyze", str(recorder.path), "--format", "html", "--out", str(out))
    assert done.returncode == 0, done.stderr
    page = browser.new_page()
    page.goto(out.as_uri())
    page.wait_for_function("document.body.dataset.rendered !== undefined")
    assert page.title() == "prefixtrace analysis"
    assert page.evaluate("window.pwned") is None
    heading = page.text_content(".break h3")  # request_local_tail/<the planted role>
    assert "<script>document.title='pwned'" in heading  # shown as text


def test_dashboard_shows_a_planted_role_as_text(recorder, browser):
    from proxy.upstream_backend import UpstreamBackend

    head = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]
    with running_server(_role_blind_upstream()) as upstream, \
            running_server(create_app(UpstreamBackend(upstream), recorder)) as url:
        page = browser.new_page()
        page.goto(url + "/ui")
        title = page.title()
        for tail in ({"role": EVIL_ROLE, "content": "c"}, {"role": "user", "content": "d"}):
            assert _post(url, {"messages": [*head, tail], "max_tokens": 2}, EVIL_SESSION).status_code == 200
        brk = page.wait_for_selector('.break[data-turn="1"]', timeout=20_000)
        assert "<script>document.title='pwned'" in brk.text_content()
        assert page.title() == title and page.evaluate("[window.pwned, window.pwnedSession]") == [None, None]


def test_analyze_html_does_not_run_a_role_planted_through_a_refused_request(engine_server, browser, tmp_path):
    url, recorder = engine_server
    _plant(url, EVIL_ROLE, EVIL_SESSION)
    recorder.flush()
    out = tmp_path / "report.html"
    done = _cli("analyze", str(recorder.path), "--format", "html", "--out", str(out))
    assert done.returncode == 0, done.stderr
    page = browser.new_page()
    page.goto(out.as_uri())
    page.wait_for_function("document.body.dataset.rendered !== undefined")
    assert page.title() == "prefixtrace analysis"
    assert page.evaluate("[window.pwned, window.pwnedSession]") == [None, None]
    assert page.evaluate("typeof window.prefixtraceReport.by_cause") == "object"  # the JSON island parsed
    # The refused turn is listed, not chained (issue 16), so the planted role is no break heading any more;
    # wherever the report shows it, it is text: nothing ran above, and the session id comes back verbatim.
    assert page.get_attribute("section.session", "data-session") == EVIL_SESSION


def test_replay_html_embeds_parseable_json_and_runs_nothing(engine_server, browser, tmp_path):
    url, recorder = engine_server
    r = _post(url, {"messages": [{"role": "user", "content": "</script><script>window.pwned=1</script>"}],
                    "max_tokens": 2, "temperature": 0}, EVIL_SESSION)
    assert r.status_code == 200
    recorder.flush()
    out = tmp_path / "replay.html"
    done = _cli("replay", str(recorder.path), "--target", url, "--out", str(out))
    assert done.returncode == 0, done.stderr
    page = browser.new_page()
    page.goto(out.as_uri())
    report = page.evaluate("JSON.parse(document.getElementById('report').textContent)")
    assert report["targets"][0]["turns"][0]["session"] == EVIL_SESSION
    assert report["targets"][0]["url"] == url
    assert page.evaluate("[window.pwned, window.pwnedSession]") == [None, None]
    assert page.title() == "prefixtrace replay"


# --- terminal text and JUnit --------------------------------------------------------


def _hostile_jsonl(tmp_path: Path) -> Path:
    """A session whose id and a role carry terminal escapes, XML-invalid characters and a
    lone surrogate (valid JSON as an escape)."""
    session = "agent" + ESCAPES + "\x01\ufffe\ud800"
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    bodies = [[*head, {"role": "tool" + ESCAPES, "content": "c"}], [*head, {"role": "user", "content": "d"}]]
    src = tmp_path / "hostile.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "session": session, "request": {"messages": m}}) + "\n"
                           for i, m in enumerate(bodies)))
    return src


def _assert_inert(output: bytes, shown: bool = True) -> None:
    text = output.decode("utf-8")  # a lone surrogate would not even encode
    for ch in ("\x1b", "\x07", "\x9b", "\u202e", "\x01"):
        assert ch not in text, repr(ch)
    assert not shown or "\\u001b" in text  # shown, not dropped


@pytest.mark.slow
def test_terminal_text_shows_escapes_instead_of_running_them(tmp_path):
    src = _hostile_jsonl(tmp_path)
    for args in (["analyze", str(src)], ["analyze", str(src), "--format", "json"], ["check", str(src)]):
        done = _cli(*args)
        assert done.returncode in (0, 1), done.stderr
        assert b"Traceback" not in done.stderr
        _assert_inert(done.stdout)
    report = json.loads(_cli("analyze", str(src), "--json").stdout)  # still the same JSON
    assert report["sessions"][0]["id"].startswith("agent\x1b]0;retitled")


def test_replay_and_db_info_text_show_escapes(engine_server, tmp_path):
    url, recorder = engine_server
    # In the body's `user` (the session id when no header names one): an HTTP parser may refuse
    # control characters in a header, but a JSON string carries anything.
    r = httpx.post(url + "/v1/chat/completions", timeout=120,
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "user": "agent" + ESCAPES})
    assert r.status_code == 200, r.text
    recorder.flush()
    for args in (["replay", str(recorder.path), "--target", url], ["db", "info", str(recorder.path)]):
        done = _cli(*args)
        assert done.returncode == 0, done.stderr
        _assert_inert(done.stdout + done.stderr, shown=args[0] == "replay")  # db info names no session


def test_check_junit_is_valid_xml_for_any_input(tmp_path):
    src, junit = _hostile_jsonl(tmp_path), tmp_path / "junit.xml"
    done = _cli("check", str(src), "--junit", str(junit))
    assert done.returncode == 1 and b"Traceback" not in done.stderr, done.stderr
    suite = ET.parse(junit).getroot()
    case = suite.find("testcase")
    assert case.get("name").startswith("session agent\\u001b]0;retitled\\u0007")
    assert "\\ud800" in case.get("name") and "\\ufffe" in case.get("name")
    assert case.find("failure").get("type") == "request_local_tail"


# --- the request guard: loopback Host, JSON bodies ----------------------------------


def test_post_that_is_not_json_is_refused_with_415_and_recorded(engine_server):
    url, recorder = engine_server
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(url + "/v1/messages", content=body)  # no Content-Type at all
    assert r.status_code == 415 and r.json()["type"] == "error"  # Anthropic's shape on its endpoint
    for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON;charset=UTF-8"):
        r = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": content_type})
        assert r.status_code == 200, (content_type, r.text)
    statuses = [(t["endpoint"], t["status"]) for t in rows(recorder)]
    assert statuses[:2] == [("/v1/chat/completions", 415), ("/v1/messages", 415)]
    assert [s for _, s in statuses[2:]] == [200, 200, 200]
    first = rows(recorder)[0]
    assert json.loads(first["request_body"])["max_tokens"] == 2 and "text/plain" in first["error"]


def test_host_header_must_be_loopback_unless_allowed(engine_server, tiny_engine, recorder):
    url, _ = engine_server
    port = url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", "localhost", f"[::1]:{port}", "LOCALHOST:1"):
        assert httpx.get(url + "/health", headers={"host": host}).status_code == 200, host
    for host in ("evil.example", f"rebind.test:{port}", "127.0.0.1.evil.example", ""):
        r = httpx.get(url + "/ui/api/sessions", headers={"host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_host", host
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                   headers={"host": "evil.example"})
    assert r.status_code == 403
    assert rows(recorder)[-1]["status"] == 403  # refused turns are recorded like any other
    with running_server(create_app(EngineBackend(tiny_engine), recorder, allowed_hosts=["proxy.lan"])) as other:
        assert httpx.get(other + "/health", headers={"host": "proxy.lan:8765"}).status_code == 200
        assert httpx.get(other + "/health", headers={"host": "localhost"}).status_code == 403
    with running_server(create_app(EngineBackend(tiny_engine), recorder, allowed_hosts=["*"])) as anyhost:
        assert httpx.get(anyhost + "/health", headers={"host": "anything.example"}).status_code == 200


def test_every_recorded_harness_request_shape_still_passes(engine_server):
    """The headers real harnesses sent (../shared/traffic, as exported) pass the guard."""
    url, _ = engine_server
    shapes = json.loads((ROOT / "fixtures" / "harness_request_headers.json").read_text())
    assert len({s["harness"] for s in shapes}) >= 8
    guard = RequestGuard(None)
    from starlette.datastructures import Headers

    for shape in shapes:
        assert guard.check("POST", Headers(shape["headers"])) is None, shape
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    for shape in shapes:  # and through the real server, with the harness's own Host (another port)
        anthropic = shape["endpoint"] == "/v1/messages"
        r = httpx.post(url + shape["endpoint"], headers=shape["headers"], timeout=120,
                       content=json.dumps({**body, "model": "tiny-llama"} if anthropic else body))
        assert r.status_code == 200, (shape, r.text)


class _Page(http.server.BaseHTTPRequestHandler):
    html = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.end_headers()
        self.wfile.write(self.html)

    def log_message(self, *args):
        pass


def test_a_page_on_another_origin_cannot_drive_or_read_the_proxy(engine_server, browser):
    url, recorder = engine_server
    r = _post(url, {"messages": [{"role": "user", "content": "my secret plan"}], "max_tokens": 2}, "victim")
    assert r.status_code == 200
    body = json.dumps({"messages": [{"role": "user", "content": "planted by a web page"}], "max_tokens": 2})
    _Page.html = f"""<script>
      window.done = Promise.allSettled([
        fetch("{url}/v1/chat/completions", {{method: "POST", mode: "no-cors", body: {json.dumps(body)},
              headers: {{"content-type": "text/plain"}}}}),
        fetch("{url}/v1/chat/completions", {{method: "POST", body: {json.dumps(body)},
              headers: {{"content-type": "application/json"}}}}),
      ]).then(rs => rs.map(r => r.status));
    </script>""".encode()
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page = browser.new_page()
        page.goto(f"http://localhost:{port}/")
        assert page.evaluate("window.done") == ["fulfilled", "rejected"]  # the CORS preflight is refused
        time.sleep(0.5)
        turns = rows(recorder)
        # The simple POST was refused and no turn ran; the CORS preflight (OPTIONS) is recorded too, as the
        # 405 every unknown method/path gets (the fallback routes, issue 15).
        assert [t["status"] for t in turns if t["status"] != 405] == [200, 415]
        # DNS rebinding: a name of the attacker's that now resolves to 127.0.0.1 reads nothing.
        response = page.goto(f"http://rebind.test:{url.rsplit(':', 1)[1]}/ui/api/sessions")
        assert response.status == 403 and "secret plan" not in page.content()
    finally:
        server.shutdown()


def test_a_refused_body_is_read_within_the_size_limit(tiny_engine, recorder):
    with running_server(create_app(EngineBackend(tiny_engine), recorder, max_request_mb=1)) as url:
        big = b'{"messages": [{"role": "user", "content": "' + b"x" * (3 << 20) + b'"}]}'
        r = httpx.post(url + "/v1/chat/completions", content=big, headers={"content-type": "text/plain"}, timeout=60)
        assert r.status_code == 415
        small = httpx.post(url + "/v1/chat/completions", content=b'{"user": "s7"}', timeout=60,
                           headers={"content-type": "text/plain"})
        assert small.status_code == 415
    first, second = rows(recorder)
    assert first["status"] == 415 and "not stored" in first["request_body"] and len(first["request_body"]) < 1000
    assert second["status"] == 415 and second["session_id"] == "s7"  # a refused turn keeps its session

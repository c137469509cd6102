"""The dashboard as a person uses it (issue 26, items 5 and 8): a real proxy on 127.0.0.1 in front
of a scripted upstream on loopback (it reports prompt and cached tokens and takes its time on the
turn whose cache broke, as a server does), driven in headless Chromium: sessions named by their
client and first message, the fix text, readable TTFT, no internal jargon, one explained hit ratio,
the session's full report one click away, and a bounded poll with 2,000 sessions."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from proxy.app import create_app
from recorder.turn import Turn
from tests.conftest import running_server
from tests.test_dashboard import ARTIFACTS, browser  # noqa: F401  (the Chromium fixture)

SCREENS = ARTIFACTS
PI_SYSTEM = ("You are an expert coding assistant operating inside pi, a coding agent harness. "
             "Todo: {n} of 5 done. Help the user.")
PI_HEADERS = {"User-Agent": "OpenAI/JS 6.26.0", "X-Session-Id": "pi-1"}


def _upstream():
    """An OpenAI-compatible upstream that counts prompt tokens (4 chars each), says it served the
    previous prompt's shared prefix from cache, and is slow in proportion to what it re-prefilled."""
    app = FastAPI()
    last: dict[str, str] = {}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        text = json.dumps(body["messages"])
        prev = last.get("p", "")
        common = next((i for i, (a, b) in enumerate(zip(prev, text)) if a != b), min(len(prev), len(text)))
        last["p"] = text
        prompt, cached = len(text) // 4, common // 4
        usage = {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1,
                 "prompt_tokens_details": {"cached_tokens": cached}}

        async def events():  # streamed, as harnesses ask: the first token after the prefill
            await asyncio.sleep(min(0.6, (prompt - cached) / 400))
            for chunk in ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "done"}}]},
                          {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                          {"choices": [], "usage": usage}):
                yield f"data: {json.dumps({'id': 'c', 'object': 'chat.completion.chunk', 'model': 'm', **chunk})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _pi_session(url: str) -> None:
    """Five turns of a pi session; the third and the fifth tick the todo counter in the system prompt."""
    messages = [{"role": "user", "content": "Fix the flaky login test please"}]
    for turn in range(5):
        n = (1, 1, 2, 2, 3)[turn]
        body = {"model": "m", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": PI_SYSTEM.format(n=n)}, *messages]}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=PI_HEADERS, timeout=30)
        assert r.status_code == 200, r.text
        messages += [{"role": "assistant", "content": f"step {turn} " + "x" * 400},
                     {"role": "user", "content": f"continue {turn}"}]


@pytest.fixture
def proxy(recorder):
    from proxy.upstream_backend import UpstreamBackend

    with running_server(_upstream()) as upstream:
        app = create_app(UpstreamBackend(upstream + "/v1"), recorder)
        with running_server(app) as url:
            yield url, app


@pytest.mark.slow
def test_a_session_reads_as_a_person_expects(proxy, browser):  # noqa: F811
    url, _ = proxy
    _pi_session(url)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(url + "/ui")
    session = page.wait_for_selector('.session[data-session="pi-1"]', timeout=15_000)
    page.wait_for_selector('.session[data-session="pi-1"] .bar[data-turn="4"]', timeout=15_000)
    # Named by client and first user message, not by an id alone.
    assert page.text_content('.session[data-session="pi-1"] .client') == "pi"
    assert "Fix the flaky login test please" in page.text_content('.session[data-session="pi-1"] .title')
    # The break: its plain name, the turn counted from 1, the fix, the differing characters.
    brk = page.wait_for_selector('.break[data-turn="2"]')
    text = brk.text_content()
    assert "system prompt rewritten" in text and "at turn 3" in text
    assert re.search(r"at turn 3: [\d.]+ s and \d+ tokens re-prefilled", text)  # seconds first
    # One counter, one fix: the break shown first (the costlier) says it, the other refers to it.
    shown = [b.get_attribute("data-turn") for b in page.query_selector_all('.session[data-session="pi-1"] .break')]
    first, second = [turn for turn in shown if turn in ("2", "4")]
    assert "system prompt" in page.text_content(f'.break[data-turn="{first}"] .fix')
    assert page.text_content(f'.break[data-turn="{second}"] .fix') == "Fix: the same as above"
    assert page.text_content('.break[data-turn="2"] del') == "1"
    assert page.text_content('.break[data-turn="2"] ins') == "2"
    # TTFT readable in full ("0.31 s"), never cut to a few pixels of digits.
    meta = session.query_selector(".meta").text_content()
    assert re.search(r"TTFT median [\d.]+ s, slowest [\d.]+ s \(turn [35]\)", meta), meta
    # No internal jargon anywhere on the page.
    body = page.inner_text("body")  # what a person sees
    for jargon in ("mid_system=", "notices=", "thinking_retention", "inferred-"):
        assert jargon not in body
    # One hit ratio, with what it is over.
    assert page.query_selector("#hit-ratio") is None
    assert "prompt tokens, as the server reported them" in page.text_content("#hit-ratio-note")
    # Click a bar: that turn's detail, with its TTFT in seconds.
    page.click('.session[data-session="pi-1"] .bar[data-turn="0"]')
    detail = page.wait_for_selector('.turn-detail[data-turn="0"]')
    assert detail.text_content().startswith("turn 1 · TTFT ") and " s · " in detail.text_content()
    # Polls that bring nothing new leave the page alone: a reader's selection and scroll stay put.
    page.evaluate("document.querySelector('.session').dataset.mark = 'still here'")
    page.wait_for_timeout(2500)
    assert page.get_attribute(".session", "data-mark") == "still here"
    page.screenshot(path=str(_shot("dashboard_session.png")), full_page=True)
    # The session's full report, one click away, served by the proxy itself.
    with page.expect_popup() as popup:
        page.click('.session[data-session="pi-1"] a.report-link')
    report = popup.value
    report.wait_for_function("document.body.dataset.rendered === '1'")
    assert "system prompt rewritten" in report.text_content("#summary")
    assert re.match(r"turn [35] of pi", report.text_content("#top-breaks a"))
    report.screenshot(path=str(_shot("dashboard_report.png")), full_page=True)


def _turn(i: int, session: str) -> Turn:
    body = {"model": "m", "messages": [{"role": "system", "content": "You are terse."},
                                       {"role": "user", "content": f"question {session} " + "y" * 200}]}
    return Turn(f"r{i}", 1_700_000_000 + i, "/v1/chat/completions", "http://up", body,
                {"user-agent": "claude-cli/2.1.197 (external, sdk-cli)"}, session_id=session, status=200,
                prompt_tokens=60, cached_tokens=0, ttft_s=0.2, total_s=0.3)


@pytest.mark.slow
def test_the_costliest_break_comes_first_not_the_newest(proxy, browser):  # noqa: F811
    """A session whose early break re-prefilled its whole history and whose later one only a short tail:
    the card shows the early, costly one first, and its line says what the breaks cost in seconds."""
    url, _ = proxy
    headers = {**PI_HEADERS, "X-Session-Id": "pi-costs"}
    messages = [{"role": "user", "content": "Fix the flaky login test please"}]
    for turn in range(5):
        messages += [{"role": "assistant", "content": f"step {turn} " + "x" * 800},
                     {"role": "user", "content": f"continue {turn}"}]
        system = PI_SYSTEM.format(n=2 if turn >= 2 else 1)  # turn 3 rewrites the head: all of it again
        sent = [dict(m) for m in messages]
        if turn == 4:  # turn 5 edits the last user message but one: a short tail again
            sent[-3]["content"] = "continue 3 (edited)"
        body = {"model": "m", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": system}, *sent]}
        assert httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30).status_code == 200
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    page.goto(url + "/ui")
    page.wait_for_selector('.session[data-session="pi-costs"] .break[data-turn="4"]', timeout=15_000)
    shown = [b.get_attribute("data-turn") for b in page.query_selector_all('.session[data-session="pi-costs"] .break')]
    assert shown == ["2", "4"], shown  # the head rewrite (turn 3) before the newer, cheaper edit (turn 5)
    meta = page.text_content('.session[data-session="pi-costs"] .meta')
    assert re.search(r"2 breaks costing [\d.]+ (ms|s), [\d,]+ tokens re-prefilled", meta), meta
    page.close()


@pytest.mark.slow
def test_two_thousand_sessions_stay_fast(proxy, browser):  # noqa: F811
    """2,000 sessions: the poll answers a page of them, and the page renders at once. The turns go
    straight into the live analysis (2,000 requests through the proxy would take minutes here);
    the API and the page are driven over the real socket."""
    url, app = proxy
    for i in range(2000):
        app.state.live.observe(_turn(i, f"s{i}"))
    t = time.perf_counter()
    first = httpx.get(url + "/ui/api/sessions", timeout=120)  # analyses the 2,000 queued turns
    analyse = time.perf_counter() - t
    t = time.perf_counter()
    poll = httpx.get(url + "/ui/api/sessions", timeout=60)
    poll_s = time.perf_counter() - t
    data = poll.json()
    assert first.status_code == poll.status_code == 200
    assert data["total_sessions"] == 2000 and len(data["sessions"]) == 25
    assert len(poll.content) < 150_000, len(poll.content)  # was 1.4 MB for all 2,000
    idle = httpx.get(url + f"/ui/api/sessions?version={data['version']}")  # nothing new: the gauges only
    assert idle.json()["unchanged"] is True and "sessions" not in idle.json() and len(idle.content) < 2_000
    older = httpx.get(url + "/ui/api/sessions?offset=1975&limit=25").json()
    assert [s["id"] for s in older["sessions"]][-1] == "s0"
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    t = time.perf_counter()
    page.goto(url + "/ui")
    page.wait_for_selector('.session[data-session="s1999"]', timeout=20_000)
    render_s = time.perf_counter() - t
    assert page.locator(".session").count() == 25
    assert page.text_content("#page-info") == "sessions 1–25 of 2,000"
    page.click("#next")
    page.wait_for_selector('.session[data-session="s1974"]', timeout=10_000)
    assert page.text_content("#page-info") == "sessions 26–50 of 2,000"
    assert page.text_content('.session[data-session="s1974"] .client') == "claude-code"
    print(f"2,000 sessions: first poll (analysis) {analyse:.2f} s, poll {poll_s:.3f} s, {len(poll.content):,} bytes, "
          f"page shown in {render_s:.2f} s")


def test_report_of_an_unknown_session_is_a_404_that_says_why(proxy):
    url, _ = proxy
    r = httpx.get(url + "/ui/report/nope")
    assert r.status_code == 404 and "prefixtrace analyze" in r.text
    r = httpx.get(url + "/ui/report/nope", headers={"host": "evil.example"})  # prompts: loopback only
    assert r.status_code == 403


def test_session_report_shows_client_text_as_text(proxy, browser):  # noqa: F811
    """The per-session report carries client text (the session id, the prompts in the diff): it is
    text on the page, whatever it spells."""
    from urllib.parse import quote

    url, _ = proxy
    evil = "s\"><script>window.pwnedSession=1</script>&amp;"
    for day in ("<script>window.pwned=1</script>Monday", "<script>window.pwned=1</script>Tuesday"):
        body = {"model": "m", "max_tokens": 2, "stream": True,
                "messages": [{"role": "system", "content": f"Today is {day}."}, {"role": "user", "content": "hi"}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": evil}, timeout=30)
        assert r.status_code == 200, r.text
    page = browser.new_page()
    page.goto(url + "/ui/report/" + quote(evil, safe=""))
    page.wait_for_function("document.body.dataset.rendered === '1'")
    assert page.evaluate("[window.pwned, window.pwnedSession]") == [None, None]
    assert page.get_attribute("section.session", "data-session") == evil
    assert "<script>window.pwned=1</script>" in page.text_content("details.break .diff")


def _shot(name: str) -> Path:
    SCREENS.mkdir(exist_ok=True)
    return SCREENS / name


TRAFFIC = Path(__file__).resolve().parents[1].parent / "shared" / "traffic"
if not TRAFFIC.is_dir():
    TRAFFIC = Path("/work/shared/traffic")


@pytest.mark.parametrize("name, client", [
    ("pi_tiny", "pi"), ("claude_tiny", "claude-code"), ("opencode_tiny", "opencode"), ("qwen_tiny", "qwen-code"),
    ("aider_tiny", "aider"), ("llm_tiny", "OpenAI/Python"),  # llm sends the OpenAI SDK's User-Agent and no prompt
])
def test_real_harness_sessions_are_named_by_client_and_question(name, client):
    """The recorded harness traffic (../shared/traffic) through the live analysis: each session named by
    its client and what the person asked, not by a harness's preamble or its title-generator request."""
    from proxy.live import LiveSessions

    path = TRAFFIC / f"{name}.jsonl"
    if not path.is_file():
        pytest.skip("no recorded harness traffic here")
    live = LiveSessions()
    for i, line in enumerate(path.read_text().splitlines()):
        r = json.loads(line)
        live.observe(Turn(r["id"], r["ts"], r["endpoint"], "up", r["request"], r.get("request_headers") or {},
                          session_id=r.get("session"), status=200))
    live.refresh()
    sessions = live.page(limit=100)["sessions"]
    main = max(sessions, key=lambda s: s["turn_count"])
    assert main["client"] == client
    if name != "llm_tiny":
        assert main["title"].startswith("Read README.md and then list the files"), main["title"]

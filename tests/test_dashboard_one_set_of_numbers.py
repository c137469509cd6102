"""The dashboard says what `analyze` says of the same turns: a real proxy on 127.0.0.1 in front of the
embedded tiny engine, real HTTP turns, the real SQLite recording. It counts with the renderer the server
recorded (not generic ChatML / o200k), prices each break's seconds as `analyze` does, calls a harness's
summariser under the session's id a side request (not a break), opens on a headline of what cost the
most, orders sessions by cost, and names a failed (499) request in its legend."""

from __future__ import annotations

import time

import httpx
import pytest

from analyzer import analyze
from conftest import TINY_MODEL, running_server
from engine.engine import Engine
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from recorder.reader import iter_turns
from recorder.store import Recorder
from tests.test_dashboard import browser  # noqa: F401  (the Chromium fixture)

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
         for n in ("read", "edit", "bash")]
PI = "You are an expert coding assistant operating inside pi, a coding agent harness. " + \
    " ".join(f"Guideline {i}: keep edits small." for i in range(20))
NOTES = " ".join(f"note {i} about widget {i * 7}." for i in range(80))


def _chat(client: httpx.Client, messages: list[dict], session: str, **extra) -> str:
    r = client.post("/v1/chat/completions", headers={"X-Session-Id": session},
                    json={"model": "default", "messages": messages, "max_tokens": 6, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"] or "ok"


def _traffic(url: str) -> None:
    with httpx.Client(base_url=url, timeout=120) as client:
        msgs = [{"role": "system", "content": PI}, {"role": "user", "content": "Fix the flaky test in tests/test_io.py"}]
        for turn in range(4):
            reply = _chat(client, msgs, "run-pi-1", tools=TOOLS)
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Now step {turn}."}]
            if turn == 1:  # pi's summariser: its own system prompt, no tools, the conversation as one message
                convo = "\n".join(f"{m['role']}: {m['content']}" for m in msgs[1:])
                _chat(client, [{"role": "system", "content": "You are a context summarization assistant."},
                               {"role": "user", "content": f"<conversation>\n{convo}\n</conversation>\nSummarize it."}],
                      "run-pi-1")
        msgs = [{"role": "user", "content": "List the files."}]
        for turn in range(4):  # a clock in the system prompt: every later turn is a break
            system = {"role": "system", "content": f"You are a coding agent. Time: 10:00:0{turn}. {NOTES}"}
            reply = _chat(client, [system, *msgs], "agent-clock")
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Next step {turn}."}]
    try:  # a client that gives up before its first token: recorded as 499
        httpx.post(url + "/v1/chat/completions", headers={"X-Session-Id": "gave-up"}, timeout=0.05,
                   json={"model": "default", "messages": [{"role": "user", "content": "Go on. " + NOTES * 6}],
                         "max_tokens": 64})
    except httpx.TimeoutException:
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, database) of a proxy that served the traffic above; the proxy stays up for the page."""
    db = tmp_path_factory.mktemp("dash") / "traffic.db"
    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32").start()
    engine.wait_ready(60)
    try:
        with Recorder(db) as rec:
            with running_server(create_app(EngineBackend(engine), rec)) as url:
                _traffic(url)
                for _ in range(100):  # the abandoned request is recorded once the engine notices
                    rec.flush()
                    if any(t.status == 499 for t in iter_turns(db)):
                        break
                    time.sleep(0.1)
                yield url, db
    finally:
        engine.shutdown()


def test_the_dashboard_counts_and_prices_as_analyze_does(served):
    url, db = served
    page = httpx.get(url + "/ui/api/sessions", timeout=60).json()
    report = analyze(db)
    assert page["renderer"] == report.renderer == "recorded:tiny-llama" and page["tokenizer"] == "recorded:tiny-llama"
    by_id = {s["id"]: s for s in page["sessions"]}
    for s in report.sessions:
        live = [t["analysis"] for t in by_id[s.id]["turns"] if t["status"] < 400]
        assert [t["prompt_tokens"] for t in live] == [t.prompt_tokens for t in s.turns], s.id
        assert [t["lost_seconds"] for t in live] == [t.lost_seconds for t in s.turns], s.id
    totals = report.to_dict()["totals"]
    head = page["headline"]
    assert (head["breaks"], head["lost_tokens"], head["lost_seconds"]) == \
        (totals["breaks"], totals["lost_tokens"], totals["lost_seconds"])
    assert head["cause"] == "system_rewrite" and head["session"] == "agent-clock"


def test_a_summariser_under_the_sessions_id_is_a_side_request_on_both(served):
    url, db = served
    page = httpx.get(url + "/ui/api/sessions", timeout=60).json()
    by_id = {s["id"]: s for s in page["sessions"]}
    assert by_id["run-pi-1"]["breaks"] == 0
    side = by_id["run-pi-1/side-1"]
    assert side["parent"] == "run-pi-1" and side["side_reason"] == "replaces the system prompt and the tools"
    assert side["turns"][0]["analysis"]["note"].startswith("side request of run-pi-1")
    report = {s.id: s for s in analyze(db).sessions}
    assert report["run-pi-1/side-1"].parent == "run-pi-1"
    assert all(t.brk is None for t in report["run-pi-1"].turns)


def test_sessions_come_costliest_first(served):
    url, _ = served
    sessions = httpx.get(url + "/ui/api/sessions", timeout=60).json()["sessions"]
    assert sessions[0]["id"] == "agent-clock" and sessions[0]["lost_seconds"] > 0
    costs = [(s["lost_seconds"], s["lost_tokens"]) for s in sessions]
    assert costs == sorted(costs, reverse=True)


def test_the_page_opens_on_the_headline_and_explains_every_bar(served, browser):  # noqa: F811
    url, _ = served
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(url + "/ui")
    page.wait_for_selector("#headline:not([hidden])")
    headline = page.inner_text("#headline")
    assert "3 cache breaks cost" in headline and "system prompt rewritten" in headline
    assert "turn 2 of" in headline or "turn 3 of" in headline or "turn 4 of" in headline
    assert "Fix:" in headline and "timestamp" in headline
    first = page.locator("section.session").first
    assert first.get_attribute("data-session") == "agent-clock"
    gave_up = page.locator('section.session[data-session="gave-up"]')
    assert "failed: the client disconnected (499)" in gave_up.locator(".legend").inner_text()
    assert "1 failed request" in gave_up.locator(".meta").inner_text()
    # Every bar's colour is one the session's legend shows.
    for section in page.locator("section.session").all():
        legend = {i.evaluate("e => getComputedStyle(e).backgroundColor") for i in section.locator(".legend i").all()}
        bars = {b.evaluate("e => getComputedStyle(e).backgroundColor") for b in section.locator(".bar .seg").all()
                if b.evaluate("e => e.getBoundingClientRect().height") > 0}
        assert bars <= legend, section.get_attribute("data-session")
    text = page.inner_text("body")
    assert "(s)" not in text and "1 turns" not in text and "1 breaks" not in text
    page.close()

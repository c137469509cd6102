"""Races: a request of a session sent before the previous one's first token is `concurrent`, with both
times; the dashboard shows it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from analyzer.analysis import analyze
from proxy.app import create_app
from tests.conftest import running_server
from tests.test_dashboard import ARTIFACTS, browser  # noqa: F401  (the Chromium fixture)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "sessions" / "cause_concurrent.jsonl"


def _records() -> list[dict]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines()]


def _write(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_sent_before_the_first_token_is_concurrent_with_both_times():
    first, turn = analyze(FIXTURE).sessions[0].turns
    brk = turn.brk
    assert brk.cause == "concurrent" and brk.where() == "the send time"
    assert brk.before == "previous turn sent 2023-11-14 22:13:20.000Z, first token 2023-11-14 22:13:23.000Z"
    assert brk.after == "this turn sent 2023-11-14 22:13:21.000Z, 2.00 s before that first token"
    assert "wait for the first token" in brk.suggestion
    # Nothing was cached before the first request: all it shares with it is lost.
    assert turn.common_prefix_tokens == 0 and turn.lost_tokens == first.prompt_tokens


def test_sent_after_the_first_token_is_no_break(tmp_path):
    records = _records()
    records[1]["ts"] = records[0]["ts"] + 3.5
    assert analyze(_write(tmp_path, records)).sessions[0].turns[1].brk is None


def test_a_request_holding_the_previous_reply_is_no_race(tmp_path):
    # It was sent after that reply, whatever the (re-timed, skewed) records say.
    records = _records()
    records[1]["request"]["messages"].insert(-1, {"role": "assistant", "content": "looking"})
    assert analyze(_write(tmp_path, records)).sessions[0].turns[1].brk is None


def test_unknown_first_token_time_is_no_race(tmp_path):
    records = _records()
    del records[0]["timing"]
    assert analyze(_write(tmp_path, records)).sessions[0].turns[1].brk is None


def _slow_upstream(delay: float):
    """An OpenAI-compatible upstream whose first token comes `delay` seconds after a request."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        await request.json()

        async def events():
            await asyncio.sleep(delay)
            for chunk in ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}}]},
                          {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}):
                yield f"data: {json.dumps({'id': 'c', 'object': 'chat.completion.chunk', 'model': 'm', **chunk})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.mark.slow
def test_dashboard_shows_the_race(recorder, browser):  # noqa: F811
    from proxy.upstream_backend import UpstreamBackend

    system = {"role": "system", "content": "You are a coding agent. " * 30}
    opening = [system, {"role": "user", "content": "Fix the flaky login test"}]
    bodies = [{"model": "m", "stream": True, "messages": opening},
              {"model": "m", "stream": True, "messages": [*opening, {"role": "user", "content": "and run the suite"}]}]
    with running_server(_slow_upstream(1.0)) as upstream:
        app = create_app(UpstreamBackend(upstream + "/v1"), recorder)
        with running_server(app) as url:
            def send(body):
                r = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "race-1"}, timeout=30)
                assert r.status_code == 200

            first = threading.Thread(target=send, args=(bodies[0],))
            first.start()
            time.sleep(0.3)  # the second leaves while the first still waits for its first token
            send(bodies[1])
            first.join()
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url + "/ui")
            brk = page.wait_for_selector('.session[data-session="race-1"] .break', timeout=15_000)
            text = brk.text_content()
            assert "sent before the previous reply's first token" in text and "at the send time" in text, text
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard_race.png"), full_page=True)

"""Renderer identity belongs to the backend that answered and rides on its turns, not in a process-wide table.

Two proxies in one process front the same upstream URL, which published one template to the first and
another to the second (a server restarted with another model between the two proxies' starts). Each
proxy's turns must name the template its own upstream backend read, and each database store that one.
"""

from __future__ import annotations

import sqlite3
import time

import httpx
from fastapi import FastAPI

from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from recorder.reader import iter_turns
from recorder.renderers import RendererInfo
from recorder.store import Recorder
from recorder.turn import Turn
from testsupport.servers import running_server

TEMPLATES = ["{% for m in messages %}A:{{ m.content }}{% endfor %}",
             "{% for m in messages %}B:{{ m.content }}{% endfor %}"]


def upstream_publishing_in_turn(templates: list[str]) -> FastAPI:
    """An OpenAI-compatible server whose GET /props names the next template at each ask."""
    app = FastAPI()
    published = iter(templates)

    @app.get("/props")
    async def props():
        return {"chat_template": next(published), "model_alias": "m", "bos_token": "<s>"}

    @app.post("/v1/chat/completions")
    async def chat():
        return {"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}

    return app


def _ask(url: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", timeout=30,
                   json={"model": "m", "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text


def test_two_proxies_on_one_upstream_url_record_their_own_renderers(tmp_path):
    with running_server(upstream_publishing_in_turn(TEMPLATES)) as up, \
            Recorder(tmp_path / "one.db") as rec_one, Recorder(tmp_path / "two.db") as rec_two:
        with running_server(create_app(UpstreamBackend(up, probe_props=True), rec_one)) as one, \
                running_server(create_app(UpstreamBackend(up, probe_props=True), rec_two)) as two:
            _ask(one)  # the first proxy reads template A
            _ask(two)  # the second reads B from the same URL
            _ask(one)
        rec_one.flush()
        rec_two.flush()
    for db, template in ((tmp_path / "one.db", TEMPLATES[0]), (tmp_path / "two.db", TEMPLATES[1])):
        ids = {turn.renderer_id for turn in iter_turns(db)}
        stored = sqlite3.connect(db).execute("SELECT id, chat_template FROM renderers").fetchall()
        assert len(ids) == 1 and None not in ids, (db.name, ids)
        assert stored == [(ids.pop(), template)], db.name


def test_a_spooled_turn_still_stores_the_renderer_it_carried(tmp_path):
    """The database is locked when the turn arrives: its row waits in the spool, and once written, the
    renderer the turn carried is stored with it (the recorder keeps it while the row waits)."""
    db = tmp_path / "traffic.db"
    info = RendererInfo("upstream", "m", TEMPLATES[0], {"bos_token": "<s>"})
    with Recorder(db, retry_s=0.3) as rec:
        rec.record(Turn("t0", 1.0, "/v1/chat/completions", "u", {"messages": []}, status=200))
        assert rec.flush(30)
        lock = sqlite3.connect(db, timeout=0)
        lock.execute("BEGIN EXCLUSIVE")
        try:
            rec.record(Turn("t1", 2.0, "/v1/chat/completions", "u", {"messages": []}, status=200,
                            renderer_id=info.id, renderer=info))
            deadline = time.monotonic() + 30
            while rec.spool_state()["spooled"] == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert rec.spool_state()["spooled"] == 1
        finally:
            lock.rollback()
            lock.close()
        assert rec.flush(30)
    stored = sqlite3.connect(db).execute("SELECT id, chat_template FROM renderers").fetchall()
    assert stored == [(info.id, TEMPLATES[0])]

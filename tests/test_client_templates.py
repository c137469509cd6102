"""Issue 14, finding 5: a client cannot replace the chat template (or, when allowed, not without bounds).

Through a real server on the tiny engine, as the probe sent it: a 60-byte template in
`chat_template_kwargs.chat_template` that allocates a gigabyte, eight of them at once, then
an ordinary request that must still be answered.
"""

from __future__ import annotations

import resource
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine import template_sandbox
from engine.engine import Engine
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from tests.conftest import TINY_MODEL, rows, running_server

HOG = "{% set x = 'a' * 10**9 %}{{ messages[0]['content'] }}"  # a gigabyte, then a short prompt
MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(url: str, template: str | None = None) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    if template is not None:
        body["chat_template_kwargs"] = {"chat_template": template}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_client_template_is_refused_by_default_and_recorded(engine_server):
    url, recorder = engine_server
    before = _peak_rss_mib()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _chat(url, HOG), range(8)))
    assert [r.status_code for r in answers] == [400] * 8
    error = answers[0].json()["error"]
    assert "client-supplied chat template" in error["message"] and "--allow-client-templates" in error["message"]
    assert _peak_rss_mib() - before < 512  # the server never ran it
    assert _chat(url).status_code == 200  # chat is not blocked
    assert [t["status"] for t in rows(recorder)] == [400] * 8 + [200]


@pytest.fixture
def permissive_server(recorder):
    engine = Engine(TINY_MODEL, name="tiny-llama", dtype="float32", allow_client_templates=True).start()
    engine.wait_ready(60)
    try:
        with running_server(create_app(EngineBackend(engine), recorder)) as url:
            yield url, recorder
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_allowed_client_template_renders_in_a_bounded_sandbox(permissive_server, monkeypatch):
    url, recorder = permissive_server
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    ok = _chat(url, plain)
    assert ok.status_code == 200, ok.text
    assert rows(recorder)[-1]["status"] == 200
    assert ok.json()["usage"]["prompt_tokens"] > 0
    before = _peak_rss_mib()
    hog = _chat(url, HOG)
    assert hog.status_code == 400 and "MiB" in hog.json()["error"]["message"], hog.text
    assert _peak_rss_mib() - before < 512  # the gigabyte was the child's problem, and it was refused
    escape = _chat(url, "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    assert escape.status_code == 400 and "unsafe" in escape.json()["error"]["message"], escape.text
    huge = _chat(url, "{% for i in range(99999) %}{{ 'x' * 90000 }}{% endfor %}")
    assert huge.status_code == 400 and "characters" in huge.json()["error"]["message"], huge.text
    monkeypatch.setattr(template_sandbox, "TIMEOUT_S", 2.0)  # a template that never ends meets the clock
    spin = _chat(url, "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")
    assert spin.status_code == 400 and "2 s" in spin.json()["error"]["message"], spin.text
    monkeypatch.undo()
    assert _chat(url).status_code == 200


@pytest.mark.slow
def test_looping_client_templates_do_not_hold_up_other_requests(permissive_server, monkeypatch):
    """16 templates that spin until their deadline, sent at once, then a request without one: it is
    answered while they are still spinning (they once took every render thread: a 20 s wait)."""
    import threading
    import time

    url, _ = permissive_server
    monkeypatch.setattr(template_sandbox, "TIMEOUT_S", 3.0)
    spin = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    assert _chat(url).status_code == 200  # warm: the first request pays for what loads once
    spinning = [threading.Thread(target=_chat, args=(url, spin)) for _ in range(16)]
    for t in spinning:
        t.start()
    time.sleep(0.5)  # all 16 are in
    start = time.monotonic()
    plain = _chat(url)
    waited = time.monotonic() - start
    assert plain.status_code == 200, plain.text
    assert waited < 3.0, f"a plain request waited {waited:.1f} s behind the client templates"
    for t in spinning:
        t.join(120)

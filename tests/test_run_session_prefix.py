"""`/s/<id>/v1/...`: the URL session prefix `prefixtrace run` gives a harness (proxy/run_session.py).

A real proxy (uvicorn on loopback, the tiny engine, real SQLite): requests under the prefix are
served as the plain paths and recorded under the URL's id, ahead of the id the client sent."""

from __future__ import annotations

import httpx

from conftest import rows


def test_url_prefix_is_served_and_recorded_as_the_session(engine_server):
    url, recorder = engine_server
    body = {"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=60) as client:
        # the client's own session header loses to the run's id in the URL
        ok = client.post(url + "/s/run-1/v1/chat/completions", json=body, headers={"X-Session-Id": "client-own"})
        assert ok.status_code == 200, ok.text
        streamed = client.post(url + "/s/run-1/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and "[DONE]" in streamed.text
        messages = client.post(url + "/s/run-1/v1/messages", json=body)
        assert messages.status_code == 200, messages.text
        assert client.get(url + "/s/run-1/v1/models").status_code == 200
        assert client.get(url + "/s/run-1/health").json()["status"] == "ok"
        refused = client.post(url + "/s/run-1/v1/chat/completions", json={"model": "x"})  # no messages: a 400
        assert refused.status_code == 400
        plain = client.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "client-own"})
        assert plain.status_code == 200
        # an id of other characters is no prefix: the path is unknown
        assert client.post(url + "/s/a%20b/v1/chat/completions", json=body).status_code == 404
        # refused before any route (not JSON: proxy/guard.py) or by none (proxy/fallback.py): still the run's
        not_json = client.post(url + "/s/run-1/v1/chat/completions", content=b"{}",
                               headers={"Content-Type": "text/plain", "X-Session-Id": "client-own"})
        assert not_json.status_code == 415
        assert client.post(url + "/s/run-1/v1/nowhere", json=body).status_code == 404
    recorded = [(r["endpoint"], r["session_id"], r["status"]) for r in rows(recorder)]
    assert recorded[:5] == [("/v1/chat/completions", "run-1", 200), ("/v1/chat/completions", "run-1", 200),
                            ("/v1/messages", "run-1", 200), ("/v1/chat/completions", "run-1", 400),
                            ("/v1/chat/completions", "client-own", 200)], recorded
    assert recorded[6:] == [("/v1/chat/completions", "run-1", 415), ("/v1/nowhere", "run-1", 404)], recorded

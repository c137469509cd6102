"""What a reply tells its turn arrives with what it sends (recorder/turn_facts.py), and the relay feeds
it in order: through a real server on the embedded engine, each protocol's streamed turn has one point on
its chunk timeline per piece the client was sent, the text the client read, and the engine's own facts
(the rendered prompt, the reply's token ids) whether the reply streamed or came whole."""

import json

import httpx
import pytest

from tests.conftest import rows

CHAT = {"model": "default", "max_tokens": 6, "messages": [{"role": "user", "content": "count to three"}]}


def _events(text: str) -> list[dict]:
    """The JSON data of each SSE event, in order ([DONE] left out)."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def _client_text(path: str, events: list[dict]) -> str:
    if path == "/v1/chat/completions":
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    if path == "/v1/completions":
        return "".join(e["choices"][0]["text"] for e in events if e["choices"])
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": "default", "max_tokens": 6, "prompt": "one two", "stream": True}),
    ("/v1/responses", {"model": "default", "max_output_tokens": 6, "input": "count to three", "stream": True}),
], ids=["chat", "completions", "responses"])
def test_a_streamed_turn_has_a_point_per_piece_sent_and_the_text_read(engine_server, path, body):
    url, recorder = engine_server
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    events = _events(r.text)
    (row,) = rows(recorder)
    assert len(json.loads(row["chunk_times"])) == len(events)  # every piece sent, in the order it went out
    assert json.loads(row["chunk_times"]) == sorted(json.loads(row["chunk_times"]))
    assert row["response_text"] == _client_text(path, events)
    render = json.loads(row["render"])
    assert render["prompt_tokens"] > 0 and len(render["reply_token_ids"]) == row["completion_tokens"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/messages", {**CHAT, "max_tokens": 6}),
    ("/v1/responses", {"model": "default", "max_output_tokens": 6, "input": "count to three"}),
    ("/v1/completions", {"model": "default", "max_tokens": 6, "prompt": "one two"}),
], ids=["chat", "messages", "responses", "completions"])
def test_a_whole_reply_tells_the_turn_with_its_body(engine_server, path, body):
    url, recorder = engine_server
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    (row,) = rows(recorder)
    render = json.loads(row["render"])
    assert render["prompt_tokens"] > 0 and len(render["reply_token_ids"]) == row["completion_tokens"] > 0
    assert row["usage"] is not None and json.loads(row["chunk_times"]) == []

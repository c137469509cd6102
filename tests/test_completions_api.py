"""POST /v1/completions (raw prompt), POST /v1/messages/count_tokens (the engine's own renderer),
and every other path (the API's error shape, recorded): on the engine and through --upstream."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from tests.conftest import rows, running_server

PROMPT = "Once upon a time, in a land of careful caches, " * 3


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="sk-test-0123456789abcdef", max_retries=0, timeout=60)


def complete(c: OpenAI, stream: bool, prompt=PROMPT):
    kwargs = dict(model="default", prompt=prompt, max_tokens=5, temperature=0)
    if stream:
        chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
        return text, finish, chunks[-1].usage
    r = c.completions.create(**kwargs)
    assert r.object == "text_completion"
    return r.choices[0].text, r.choices[0].finish_reason, r.usage


@pytest.mark.parametrize("stream", [False, True])
def test_completions_render_no_template_reuse_the_prefix_and_are_recorded(engine_server, tiny_engine, stream):
    url, recorder = engine_server
    c = client(url)
    first = complete(c, stream)
    second = complete(c, stream, prompt=[PROMPT + "there"])  # a list of one prompt
    raw = tiny_engine.tokenizer.encode(PROMPT)
    assert first[2].prompt_tokens == len(raw)  # the prompt as it is, no chat template around it
    assert first[1] == "length" and first[2].completion_tokens == 5
    assert second[2].prompt_tokens_details.cached_tokens >= len(raw) - 4
    recorded = rows(recorder)
    assert [r["endpoint"] for r in recorded] == ["/v1/completions"] * 2
    for row, (text, finish, usage) in zip(recorded, (first, second)):
        assert row["status"] == 200 and row["response_text"] == text and row["finish_reason"] == finish
        assert (row["prompt_tokens"], row["cached_tokens"]) == (usage.prompt_tokens,
                                                                usage.prompt_tokens_details.cached_tokens)


def test_completions_refuse_what_the_engine_cannot_do(engine_server):
    url, recorder = engine_server
    for body in ({"prompt": [1, 2, 3]}, {"prompt": ["a", "b"]}, {}, {"prompt": "x", "echo": True},
                 {"prompt": "x", "logprobs": 2}):
        r = httpx.post(url + "/v1/completions", json={"model": "default", **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body, r.text)
    assert {(t["endpoint"], t["status"]) for t in rows(recorder)} == {("/v1/completions", 400)}


MESSAGES_BODY = {"model": "default", "system": "You are terse.", "tools": [
    {"name": "Read", "description": "Read a file", "input_schema": {"type": "object", "properties": {
        "path": {"type": "string"}}, "required": ["path"]}}],
    "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "Agents: none."}]}


def test_count_tokens_is_the_engines_own_prompt_length(engine_server):
    url, recorder = engine_server
    count = httpx.post(url + "/v1/messages/count_tokens", json=MESSAGES_BODY, timeout=60)
    assert count.status_code == 200, count.text
    sent = httpx.post(url + "/v1/messages", json={**MESSAGES_BODY, "max_tokens": 2}, timeout=60).json()
    usage = sent["usage"]
    assert count.json() == {"input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]}
    counted = rows(recorder)[0]
    assert counted["endpoint"] == "/v1/messages/count_tokens" and counted["prompt_tokens"] == count.json()["input_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_and_count_tokens_pass_through_an_upstream(chain, stream):
    url_a, rec_a, rec_b = chain
    text, finish, usage = complete(client(url_a), stream)
    count = httpx.post(url_a + "/v1/messages/count_tokens", json=MESSAGES_BODY, timeout=60)
    assert count.status_code == 200 and count.json()["input_tokens"] > 0
    a, b = rows(rec_a), rows(rec_b)
    assert [r["endpoint"] for r in a] == [r["endpoint"] for r in b] == ["/v1/completions",
                                                                       "/v1/messages/count_tokens"]
    assert a[0]["response_text"] == b[0]["response_text"] == text and a[0]["finish_reason"] == finish
    assert a[0]["prompt_tokens"] == usage.prompt_tokens and a[1]["prompt_tokens"] == count.json()["input_tokens"]


def test_unknown_paths_answer_in_the_apis_error_shape_and_are_recorded(engine_server):
    url, recorder = engine_server
    r = httpx.get(url + "/v1/files", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url" and "detail" not in r.json()
    r = httpx.post(url + "/v1/messages/batches", json={"requests": []}, timeout=30)
    assert r.status_code == 404 and r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(url + "/v1/chat/completions", timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == "method_not_allowed"
    assert httpx.head(url + "/", timeout=30).status_code == 200  # Claude Code's preflight
    assert httpx.options(url + "/v1/chat/completions", timeout=30).status_code == 405  # CORS: refused, unrecorded
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 200
    recorded = [(t["endpoint"], t["status"]) for t in rows(recorder)]
    assert recorded == [("/v1/files", 404), ("/v1/messages/batches", 404), ("/v1/chat/completions", 405)]


def test_an_unknown_path_is_held_to_the_request_size_limit(tiny_engine, recorder):
    with running_server(create_app(EngineBackend(tiny_engine), recorder, max_request_mb=1)) as url:
        r = httpx.post(url + "/v1/uploads", content=b'{"x": "' + b"y" * (2 << 20) + b'"}', timeout=60,
                       headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    [row] = rows(recorder)
    assert row["endpoint"] == "/v1/uploads" and row["status"] == 413 and len(row["request_body"]) < 200

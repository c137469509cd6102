"""The proxy with the embedded engine, driven over HTTP by the official openai client."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import rows

SYSTEM = "You are a careful coding assistant. Answer briefly."


def generation_prompt_tokens(engine) -> int:
    return len(engine.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False))


@pytest.mark.parametrize("stream", [False, True])
def test_two_turns_reuse_the_prefix_and_are_recorded(openai_client, engine_server, tiny_engine, stream):
    _, recorder = engine_server
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a haiku."}]

    def turn(msgs):
        if not stream:
            r = openai_client.chat.completions.create(model="default", messages=msgs, max_tokens=12, temperature=0)
            return r.choices[0].message.content, r.usage
        chunks = list(openai_client.chat.completions.create(
            model="default", messages=msgs, max_tokens=12, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = [c.usage for c in chunks if c.usage]
        assert len(usage) == 1 and not chunks[-1].choices  # usage arrives once, last
        return text, usage[0]

    text1, usage1 = turn(messages)
    messages += [{"role": "assistant", "content": text1}, {"role": "user", "content": "Another one."}]
    text2, usage2 = turn(messages)

    assert usage1.prompt_tokens_details.cached_tokens == 0
    assert usage2.prompt_tokens > usage1.prompt_tokens
    assert usage2.prompt_tokens_details.cached_tokens >= usage1.prompt_tokens - generation_prompt_tokens(tiny_engine)
    assert usage2.prompt_tokens_details.cached_tokens < usage2.prompt_tokens

    recorded = rows(recorder)
    assert len(recorded) == 2
    for row, usage, text in zip(recorded, (usage1, usage2), (text1, text2)):
        assert row["status"] == 200
        assert row["prompt_tokens"] == usage.prompt_tokens
        assert row["completion_tokens"] == usage.completion_tokens
        assert row["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
        assert row["response_text"] == text
        assert row["total_s"] > 0 and row["ttft_s"] is not None and row["ttft_s"] <= row["total_s"]
        assert bool(row["stream"]) is stream
    assert json.loads(recorded[1]["request_body"])["messages"][2]["content"] == text1


def test_models_lists_the_model_and_its_alias(openai_client):
    ids = {m.id for m in openai_client.models.list().data}
    assert ids == {"tiny-llama", "default"}


def test_health_is_ok_once_loaded(engine_server):
    url, _ = engine_server
    r = httpx.get(url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


@pytest.mark.parametrize(
    "body, status, words",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"", 400, "empty"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"model": "default"}).encode(), 400, "messages"),
        (json.dumps({"model": "default", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "role"),
        (json.dumps({"model": "default", "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}).encode(),
         400, "'text' must be a string"),
        (json.dumps({"model": "default", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}).encode(), 400, "temperature"),
        (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "no-such-model"),
        # A max_tokens beyond the context is clamped (tests/test_anthropic_route.py); a prompt that cannot fit is not.
        (json.dumps({"model": "default", "messages": [{"role": "user", "content": "x " * 40000}]}).encode(), 400, "context"),
    ],
)
def test_bad_input_gets_a_reason_and_is_recorded(engine_server, body, status, words):
    url, recorder = engine_server
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    assert words in r.json()["error"]["message"]
    recorded = rows(recorder)
    assert len(recorded) == 1 and recorded[0]["status"] == status and words in recorded[0]["error"]


def test_stop_sequence_and_max_tokens(openai_client):
    msgs = [{"role": "user", "content": "count"}]
    full = openai_client.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason in ("length", "stop")
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("greedy output has no usable stop string")
    cut = openai_client.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_secrets_never_reach_the_database(engine_server):
    url, recorder = engine_server
    secret = "sk-proj-" + "A1b2C3d4" * 6
    httpx.post(
        url + "/v1/chat/completions",
        json={"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": f"my key is {secret}"}]},
        headers={"Authorization": f"Bearer {secret}", "x-api-key": secret, "Cookie": f"session={secret}"},
    )
    recorder.flush()
    recorder.close()
    for suffix in ("", "-wal", "-shm"):
        path = recorder.path.with_name(recorder.path.name + suffix)
        if path.exists():
            assert secret.encode() not in path.read_bytes()


def test_an_event_for_a_closed_loop_is_dropped_not_raised_into_the_engine_thread():
    import asyncio

    from engine.sequence import TextDelta

    loop = asyncio.new_event_loop()
    outbox = loop.run_until_complete(_outbox_on_the_loop())  # made on its reader's loop
    outbox.put(TextDelta("a", [1]))  # delivered while the loop is open
    loop.run_until_complete(asyncio.sleep(0))
    assert loop.run_until_complete(outbox.get()) == TextDelta("a", [1])
    loop.close()
    outbox.put(TextDelta("b", [2]))  # after shutdown: nobody listens, nothing raised


async def _outbox_on_the_loop():
    from engine.sequence import Outbox

    return Outbox()

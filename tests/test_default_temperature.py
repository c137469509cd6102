"""`serve --default-temperature`: requests that set no temperature sample at the server's choice;
a request's own temperature wins (proxy/sampling_defaults.py)."""

from __future__ import annotations

from click.testing import CliRunner
from openai import OpenAI

from conftest import running_server
from prefixtrace.cli import cli
from proxy.sampling_defaults import SamplingDefaults
from proxy.app import create_app
from proxy.engine_backend import EngineBackend

MESSAGES = [{"role": "user", "content": "Say something."}]


def _texts(url: str, n: int, **extra) -> list[str]:
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return [client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=24, **extra)
            .choices[0].message.content for _ in range(n)]


def test_requests_without_temperature_sample_at_the_default(tiny_engine, recorder):
    backend = EngineBackend(tiny_engine, defaults=SamplingDefaults(temperature=0.0))
    with running_server(create_app(backend, recorder)) as url:
        greedy = _texts(url, 3)
        sampled = _texts(url, 3, temperature=1.0)
    assert len(set(greedy)) == 1, greedy  # temperature 0: one answer
    assert len(set(sampled)) > 1, sampled  # the request's own temperature is kept
    bodies = [r["request_body"] for r in __import__("conftest").rows(recorder)]
    assert all('"temperature"' not in b for b in bodies[:3]), "the recorded body is what the client sent"


def test_without_the_option_requests_sample_at_openais_default(engine_server):
    url, _ = engine_server
    assert len(set(_texts(url, 3))) > 1


def test_default_temperature_out_of_range_is_a_usage_error():
    result = CliRunner().invoke(cli, ["serve", "--default-temperature", "3"])
    assert result.exit_code == 2 and "--default-temperature" in result.output


def test_requests_without_an_output_cap_stop_at_the_default_on_every_stream(tiny_engine, recorder):
    """`--default-max-tokens`: a Responses request with no max_output_tokens (as Codex sends them)
    stops at the default, streamed too; one that sets its own cap keeps it."""
    backend = EngineBackend(tiny_engine, defaults=SamplingDefaults(temperature=0.0, max_tokens=7))
    with running_server(create_app(backend, recorder)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        whole = client.responses.create(model="default", input="Go on.")
        with client.responses.stream(model="default", input="Go on.") as s:
            streamed = s.get_final_response()
        own = client.responses.create(model="default", input="Go on.", max_output_tokens=3)
    assert whole.usage.output_tokens == 7 and whole.status == "incomplete"
    assert streamed.usage.output_tokens == 7
    assert own.usage.output_tokens == 3


def test_legacy_completions_get_the_defaults_too(tiny_engine, recorder):
    """/v1/completions takes another way into the engine (a raw prompt, no chat template); the
    defaults apply there as well (they did not when they wrapped only the chat route's entry)."""
    backend = EngineBackend(tiny_engine, defaults=SamplingDefaults(temperature=0.0, max_tokens=5))
    with running_server(create_app(backend, recorder)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        replies = [client.completions.create(model="default", prompt="Once upon a time") for _ in range(3)]
        own = client.completions.create(model="default", prompt="Once upon a time", max_tokens=2)
    assert [r.usage.completion_tokens for r in replies] == [5, 5, 5]
    assert len({r.choices[0].text for r in replies}) == 1  # temperature 0: one answer
    assert own.usage.completion_tokens == 2

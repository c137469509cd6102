"""presence_penalty / frequency_penalty (OpenAI) and repetition_penalty (vLLM's extension) on the
embedded engine: mlx-lm's arithmetic over the reply's own tokens (engine/sampling.py), and the
`serve --default-frequency-penalty` test aid (proxy/engine_backend.py)."""

from __future__ import annotations

import queue

import mlx.core as mx
import openai
import pytest
from openai import OpenAI

from conftest import rows, running_server
from engine.sampling import GeneratedTokenPenalties, SamplingParams, make_penalties
from engine.sequence import Failed, Finished, Sequence
from proxy.app import create_app
from proxy.sampling_defaults import SamplingDefaults
from proxy.engine_backend import EngineBackend

MESSAGES = [{"role": "user", "content": "Say something."}]


def test_penalties_count_the_reply_not_the_prompt():
    penalties = GeneratedTokenPenalties(SamplingParams(frequency_penalty=1.0))
    prompt = mx.array([3, 3, 5])
    logits = mx.zeros((1, 8))
    first = penalties(prompt, logits)  # the first call sees the prompt alone: nothing generated yet
    assert mx.array_equal(first, logits)
    after = penalties(mx.array([3, 3, 5, 7, 7]), mx.zeros((1, 8)))
    changed = [i for i, v in enumerate(after[0].tolist()) if v != 0]
    assert changed == [7], after  # 3 and 5 are the prompt's: not penalised
    assert after[0, 7].item() == pytest.approx(-2.0)  # frequency: once per occurrence


def test_a_row_without_penalties_adds_no_processor():
    assert make_penalties(SamplingParams()) == []
    assert len(make_penalties(SamplingParams(presence_penalty=0.5))) == 1


def _output_ids(engine, **params) -> list[int]:
    """Greedy output token ids of the engine itself (the HTTP reply has no logprobs to count by)."""
    done: queue.Queue = queue.Queue()
    seq = Sequence(engine.render(MESSAGES).token_ids, SamplingParams(temperature=0, max_tokens=40, **params),
                   lambda event: isinstance(event, (Finished, Failed)) and done.put(event))
    engine.submit(seq)
    event = done.get(timeout=60)
    assert isinstance(event, Finished), event
    return list(seq.output_ids)


def test_a_strong_repetition_penalty_stops_greedy_repeats(tiny_engine):
    plain = _output_ids(tiny_engine)
    penalised = _output_ids(tiny_engine, repetition_penalty=10.0)
    assert len(plain) - len(set(plain)) > 0, plain  # the random fixture repeats itself when greedy
    assert len(penalised) - len(set(penalised)) < len(plain) - len(set(plain)), (plain, penalised)


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3),
                                          ("repetition_penalty", 0)])
def test_a_penalty_out_of_range_is_a_400(openai_client, field, value):
    with pytest.raises(openai.BadRequestError, match=field):
        openai_client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2,
                                              extra_body={field: value})


def test_default_frequency_penalty_applies_to_requests_that_set_none(tiny_engine, recorder):
    backend = EngineBackend(tiny_engine, defaults=SamplingDefaults(frequency_penalty=2.0))
    with running_server(create_app(backend, recorder)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        texts = [client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=40, temperature=0,
                                                **extra).choices[0].message.content
                 for extra in ({}, {"frequency_penalty": 0.0}, {"frequency_penalty": 2.0})]
    defaulted, own_zero, own_two = texts
    assert defaulted == own_two and defaulted != own_zero, texts  # the request's own 0.0 means no penalty
    assert '"frequency_penalty"' not in rows(recorder)[0]["request_body"]  # recorded as the client sent it


def test_the_default_penalty_leaves_a_forced_call_alone(tiny_engine, recorder):
    """A grammar-forced reply decodes exactly as without the default: the penalty is for free answers."""
    tools = [{"type": "function", "function": {"name": "read", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 40}}, "required": ["path"]}}}]
    calls = []
    for backend in (EngineBackend(tiny_engine), EngineBackend(tiny_engine, defaults=SamplingDefaults(frequency_penalty=2.0))):
        with running_server(create_app(backend, recorder)) as url:
            client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
            reply = client.chat.completions.create(model="default", messages=MESSAGES, tools=tools,
                                                   tool_choice="required", max_tokens=40, temperature=0)
            calls.append(reply.choices[0].message.tool_calls[0].function.arguments)
    assert calls[0] == calls[1], calls

"""Reasoning from the embedded engine (docs/TOOLS.md): the switches reach the template
(`enable_thinking` from chat_template_kwargs, `reasoning_effort`, Anthropic `thinking`), and what the model
writes inside `<think>…</think>` comes back as `reasoning_content` / `thinking` blocks.

The tiny model's template is the real Qwen3 one (fixtures/qwen3.jinja): with thinking off it writes an
empty `<think>\\n\\n</think>\\n\\n` into the prompt. For output, a copy of the model whose template opens
the block for the model (as Qwen3 "Thinking" checkpoints do) makes its random output reasoning.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from engine.chat_render import thinking_kwargs
from engine.engine import Engine
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from recorder.store import Recorder
from tests.conftest import ROOT, TINY_MODEL, rows, running_server
from tests.test_tool_calls import MESSAGES, SCHEMAS, TOOLS

anthropic = pytest.importorskip("anthropic")
EMPTY_THINK = "<think>\n\n</think>\n\n"


def test_thinking_kwargs():
    assert thinking_kwargs(None) is None
    assert thinking_kwargs(None, "none") == {"enable_thinking": False, "reasoning_effort": "none"}
    assert thinking_kwargs(None, "high") == {"enable_thinking": True, "reasoning_effort": "high"}
    assert thinking_kwargs({"enable_thinking": True}, "none")["enable_thinking"] is True  # the client's own wins
    assert thinking_kwargs(None, thinking="disabled") == {"enable_thinking": False}
    assert thinking_kwargs(None, thinking="adaptive") == {"enable_thinking": True}


def _prompt_tokens(openai_client, **extra) -> int:
    reply = openai_client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=1, temperature=0,
                                                  **extra)
    return reply.usage.prompt_tokens


def test_switches_reach_the_template(openai_client, tiny_engine, engine_server):
    empty_block = len(tiny_engine.tokenizer.encode(EMPTY_THINK, add_special_tokens=False))
    base = _prompt_tokens(openai_client)
    assert _prompt_tokens(openai_client, extra_body={"reasoning_effort": "none"}) == base + empty_block
    assert _prompt_tokens(openai_client, extra_body={"reasoning_effort": "high"}) == base
    assert _prompt_tokens(openai_client, extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == \
        base + empty_block
    client = anthropic.Anthropic(base_url=engine_server[0], api_key="x", max_retries=0, timeout=60)

    def messages_prompt(thinking):
        usage = client.messages.create(model="default", max_tokens=1, messages=MESSAGES,
                                       extra_body={"thinking": thinking, "temperature": 0}).usage
        return usage.input_tokens + usage.cache_read_input_tokens

    assert messages_prompt({"type": "disabled"}) == base + empty_block
    assert messages_prompt({"type": "adaptive"}) == base
    assert messages_prompt({"type": "enabled", "budget_tokens": 1024}) == base


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    """The tiny model with a template whose generation prompt opens `<think>` unless thinking is off."""
    target = tmp_path_factory.mktemp("thinking") / "tiny-thinking"
    shutil.copytree(TINY_MODEL, target)
    template = (ROOT / "fixtures" / "qwen3.jinja").read_text()
    opened = template.replace(
        "{%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}",
        "{%- if enable_thinking is defined and enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}"
        "\n    {%- else %}\n        {{- '<think>\\n' }}")
    assert opened != template
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = opened
    config_path.write_text(json.dumps(config))
    return target


@pytest.fixture
def thinking_server(thinking_model, tmp_path):
    engine = Engine(thinking_model, name="tiny-thinking", dtype="float32").start()
    engine.wait_ready(60)
    with Recorder(tmp_path / "t.db") as rec, running_server(create_app(EngineBackend(engine), rec)) as url:
        yield url, rec, engine
    engine.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_output_inside_the_open_block_is_reasoning_content(thinking_server, stream):
    from openai import OpenAI

    url, rec, engine = thinking_server
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    kwargs = dict(model="default", messages=MESSAGES, max_tokens=12, temperature=0)
    if stream:
        reasoning = content = ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning_content", None) or ""
                content += choice.delta.content or ""
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = getattr(message, "reasoning_content", None) or "", message.content or ""
    assert reasoning, "the output started inside <think>: it is reasoning"
    assert "<think>" not in reasoning + content and "</think>" not in reasoning + content
    (row,) = rows(rec)
    assert row["reasoning_text"] == reasoning and row["response_text"] == content
    # Thinking off: the template closes the block, and the same output is the answer.
    off = client.chat.completions.create(extra_body={"reasoning_effort": "none"}, **kwargs).choices[0].message
    assert off.content and not getattr(off, "reasoning_content", None)


@pytest.mark.parametrize("stream", [False, True])
def test_messages_thinking_blocks(thinking_server, stream):
    url, rec, engine = thinking_server
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
    kwargs = dict(model="default", max_tokens=12, messages=MESSAGES, extra_body={"temperature": 0})
    if stream:
        with client.messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    thinking = [b for b in message.content if b.type == "thinking"]
    assert thinking and thinking[0].thinking and message.content[0].type == "thinking"
    (row,) = rows(rec)
    assert row["reasoning_text"] == "".join(b.thinking for b in thinking)


def test_a_forced_call_closes_the_open_block_first(thinking_server):
    from openai import OpenAI

    url, rec, engine = thinking_server
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0)
    (call,) = reply.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert not getattr(reply.choices[0].message, "reasoning_content", None)
    assert reply.choices[0].finish_reason == "tool_calls"

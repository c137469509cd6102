"""Render an OpenAI chat request into prompt token ids with the model's own template.

The model's chat template decides the prompt, so the engine renders with it
(through the tokenizer mlx-lm loaded) instead of a generic format: that is the
prompt whose prefix the cache must match turn after turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from prefixtrace.errors import InvalidRequest
from prefixtrace.wire.normalize import template_message

ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(slots=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]
    policy: dict | None = None  # what engine/render_policy.py applied (turn.render["policy"])


def normalize_messages(messages: Any) -> list[dict]:
    """Validate OpenAI messages and reduce them to what chat templates expect.

    Templates index `content` as a string, so text-part arrays are flattened and
    a missing content (an assistant turn that only calls tools) becomes "". The rest
    of what servers do before the template (developer -> system, tool-call arguments
    parsed into objects) is `template_message`, shared with the analyzer so that it
    predicts the prompt this engine builds (docs/ANALYZER.md "Render as servers render").
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty array", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {sorted(ROLES)}, got {role!r}", param="messages")
        m = dict(message)
        m["content"] = _flatten_content(m.get("content"), i)  # strict: a part it cannot render is a 400
        out.append(template_message(m))
    return out


def _flatten_content(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif isinstance(part, dict) and part.get("type") == "text":
                raise InvalidRequest(f"messages[{index}]: a text part's 'text' must be a string")
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequest(f"messages[{index}]: content part of type {kind!r} is not supported by this engine")
        return "".join(texts)
    raise InvalidRequest(f"messages[{index}].content must be a string or an array of text parts")


def render_prompt(
    tokenizer,
    messages: list[dict],
    *,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    allow_client_template: bool = False,
) -> RenderedPrompt:
    """`chat_template_kwargs.chat_template` (a client's own template) is refused unless
    `allow_client_template`; then it renders in a bounded child process (engine/template_sandbox.py)."""
    kwargs = dict(chat_template_kwargs or {})
    kwargs.pop("add_generation_prompt", None)
    kwargs.pop("tokenize", None)
    client_template = kwargs.pop("chat_template", None)
    if client_template is not None and not allow_client_template:
        raise InvalidRequest("a client-supplied chat template (chat_template_kwargs.chat_template) is refused: "
                             "the model's own template renders every prompt (serve --allow-client-templates "
                             "accepts them, rendered in a bounded sandbox)", param="chat_template_kwargs")
    if client_template is not None:
        return _render_with_client_template(tokenizer, client_template, messages, tools, kwargs)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except TemplateError as exc:
        raise InvalidRequest(f"the chat template rejected the messages: {exc}") from exc
    except (TypeError, KeyError, AttributeError) as exc:
        raise InvalidRequest(f"the chat template could not render the messages: {exc!r}") from exc
    # The template already wrote every special token (BOS included when the
    # template wants one), so the tokenizer must not add its own.
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    return RenderedPrompt(text=text, token_ids=list(token_ids))


def thinking_kwargs(chat_template_kwargs: dict | None, reasoning_effort: str | None = None,
                    thinking: str | None = None) -> dict | None:
    """The template kwargs a request's reasoning switches become (docs/TOOLS.md).

    `enable_thinking` is the switch Qwen3-style templates read (mlx-lm's TokenizerWrapper renames it for
    a tokenizer whose renderer calls it `thinking`, and defaults it to whether the vocabulary has
    thinking markers). OpenAI's `reasoning_effort` "none" turns it off and any other effort on, and the
    effort itself is passed as `reasoning_effort` for templates that read it (gpt-oss); Anthropic's
    `thinking.type` "disabled" turns it off, "enabled" and "adaptive" on. What the client set in
    `chat_template_kwargs` wins. A template that reads neither ignores them.
    """
    kwargs = dict(chat_template_kwargs or {})
    if reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", reasoning_effort)
        kwargs.setdefault("enable_thinking", reasoning_effort != "none")
    if thinking is not None:
        kwargs.setdefault("enable_thinking", thinking != "disabled")
    return kwargs or None


def _render_with_client_template(tokenizer, template, messages, tools, kwargs) -> RenderedPrompt:
    from engine.template_sandbox import render_client_template

    if not isinstance(template, str):
        raise InvalidRequest("chat_template_kwargs.chat_template must be a string", param="chat_template_kwargs")
    specials = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    context = {**{k: v for k, v in specials.items() if isinstance(v, str)}, **kwargs,
               "messages": messages, "tools": tools or None, "add_generation_prompt": True}
    text = render_client_template(template, context)
    return RenderedPrompt(text=text, token_ids=list(tokenizer.encode(text, add_special_tokens=False)))

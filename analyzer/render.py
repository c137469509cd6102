"""Canonical text rendering of a chat request, for prefix comparison.

The server's prefix cache hits only while the *rendered* prompt of a request
extends the previous one, so the analyzer compares renderings, not JSON. We
cannot know each server's chat template, so we use one ChatML-like form that
keeps everything a template would plausibly render and drops what none does:

    <|im_start|>tools\\n[...tools JSON...]<|im_end|>\\n      (only with tools)
    <|im_start|>{role}\\n{content}<|im_end|>\\n               (per message)
    <|im_start|>assistant\\n                                 (generation prompt)

Tools come first because real templates put them into the system prompt.
JSON is dumped with keys in the order the client sent them: HF chat templates
render `tojson` without sorting, so a client that reorders keys really does
break the cache, and we want to see that. Sampling and transport fields
(`stream`, `max_tokens`, `temperature`, `prompt_cache_key`, ...) are never
rendered and `cache_control` markers are stripped everywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from prefixtrace.errors import InvalidRequest

START, END = "<|im_start|>", "<|im_end|>\n"
GENERATION_PROMPT = f"{START}assistant\n"
IGNORED_KEYS = frozenset({"cache_control"})


@dataclass(frozen=True, slots=True)
class MessageSpan:
    start: int  # block start: the `<|im_start|>` of this message
    body_start: int  # first char after the role line: offsets "inside the message" count from here
    end: int  # one past the block's trailing newline


@dataclass(frozen=True, slots=True)
class Rendered:
    """A rendered request. `text[:prompt_end]` is everything but the
    generation prompt; `spans[i]` is message i's [start, end)."""

    text: str
    spans: list[MessageSpan]
    tools_span: tuple[int, int] | None
    prompt_end: int

    @property
    def num_messages(self) -> int:
        return len(self.spans)

    def locate(self, offset: int) -> tuple[str, int | None, int | None]:
        """Where char `offset` falls: (region, message index, offset in body).

        region is "tools", "header" (a message's role line), "body",
        "generation_prompt" or "end" (offset at or past the end of the text).
        """
        if self.tools_span and self.tools_span[0] <= offset < self.tools_span[1]:
            return "tools", None, None
        for i, span in enumerate(self.spans):
            if span.start <= offset < span.end:
                if offset < span.body_start:
                    return "header", i, None
                return "body", i, offset - span.body_start
        if offset < len(self.text):
            return "generation_prompt", None, None
        return "end", None, None


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in IGNORED_KEYS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _dumps(value: Any) -> str:
    return json.dumps(_strip(value), ensure_ascii=False)


def _content_text(content: Any) -> str:
    """Flattens string content or an array of parts. Text parts are
    concatenated as-is (as most templates do); other parts (images, Anthropic
    tool_use/tool_result blocks) render as JSON, since changing them changes
    what the server sees."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text") and "text" in part:
                out.append(str(part["text"]))
            else:
                out.append(_dumps(part))
        return "".join(out)
    return _dumps(content)


def _message_body(msg: dict) -> str:
    body = _content_text(msg.get("content"))
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        # Clients that drop past reasoning from history change the prompt;
        # render it where Qwen/DeepSeek-style templates put it.
        body = f"<think>\n{reasoning}\n</think>\n{body}"
    if msg.get("tool_calls"):
        body += ("\n" if body else "") + _dumps(msg["tool_calls"])
    return body


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest('request has no "messages" list')
    system = body.get("system")  # Anthropic /v1/messages keeps it top-level
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"message {i} is not an object")
    return messages


def render_request(body: Any) -> Rendered:
    """Renders a chat-completions (or Anthropic messages) request body, or a
    completions body (`prompt` string, one pseudo-message). Raises
    `InvalidRequest` for anything else (e.g. a body that was not JSON)."""
    if not isinstance(body, dict):
        raise InvalidRequest(f"cannot render a {type(body).__name__} request body")
    if "messages" not in body and isinstance(body.get("prompt"), str):
        text = body["prompt"]
        return Rendered(text, [MessageSpan(0, 0, len(text))], None, len(text))

    parts: list[str] = []
    pos = 0
    tools_span = None
    if body.get("tools"):
        block = f"{START}tools\n{_dumps(body['tools'])}{END}"
        parts.append(block)
        tools_span = (0, len(block))
        pos = len(block)
    spans = []
    for msg in _messages(body):
        role = str(msg.get("role", ""))
        if msg.get("name"):
            role += f" name={msg['name']}"
        header = f"{START}{role}\n"
        block = f"{header}{_message_body(msg)}{END}"
        spans.append(MessageSpan(pos, pos + len(header), pos + len(block)))
        parts.append(block)
        pos += len(block)
    prompt_end = pos
    parts.append(GENERATION_PROMPT)
    return Rendered("".join(parts), spans, tools_span, prompt_end)

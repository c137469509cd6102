"""Render an OpenAI chat request into prompt token ids with the model's own template.

The model's chat template decides the prompt, so the engine renders with it
(through the tokenizer mlx-lm loaded) instead of a generic format: that is the
prompt whose prefix the cache must match turn after turn.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from prefixtrace.common.errors import InvalidRequest
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
    token_limit: int | None = None,
    bound: "TokenBound | None" = None,
) -> RenderedPrompt:
    """`chat_template_kwargs.chat_template` (a client's own template) is refused unless
    `allow_client_template`; then it renders in a bounded child process (engine/template_sandbox.py).
    A prompt of `token_limit` tokens or more is `PromptOverLimit`, found without tokenizing all of a
    huge one (`encode_within`)."""
    kwargs = dict(chat_template_kwargs or {})
    kwargs.pop("add_generation_prompt", None)
    kwargs.pop("tokenize", None)
    client_template = kwargs.pop("chat_template", None)
    if client_template is not None and not allow_client_template:
        raise InvalidRequest("a client-supplied chat template (chat_template_kwargs.chat_template) is refused: "
                             "the model's own template renders every prompt (serve --allow-client-templates "
                             "accepts them, rendered in a bounded sandbox)", param="chat_template_kwargs")
    if client_template is not None:
        return _render_with_client_template(tokenizer, client_template, messages, tools, kwargs, token_limit, bound)
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
    token_ids = encode_within(tokenizer, text, token_limit, bound, add_special_tokens=False)
    return RenderedPrompt(text=text, token_ids=token_ids)


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


def _render_with_client_template(tokenizer, template, messages, tools, kwargs, token_limit, bound) -> RenderedPrompt:
    from engine.template_sandbox import render_client_template

    if not isinstance(template, str):
        raise InvalidRequest("chat_template_kwargs.chat_template must be a string", param="chat_template_kwargs")
    specials = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    context = {**{k: v for k, v in specials.items() if isinstance(v, str)}, **kwargs,
               "messages": messages, "tools": tools or None, "add_generation_prompt": True}
    text = render_client_template(template, context)
    return RenderedPrompt(text=text, token_ids=encode_within(tokenizer, text, token_limit, bound, add_special_tokens=False))


# --- a prompt that cannot fit, found before it is tokenized in full (issue 25, finding 2) -------------
#
# A 30 MB prompt took 95 s and 4 GB to tokenize before the context check refused it. Two checks
# come first now for a text over `EXACT_BELOW_CHARS` (one under it is counted exactly, so a refusal
# names its exact size), each cheaper than the last is expensive:
#
# 1. A bound proven from the tokenizer's own definition (`TokenBound`): every token stands for at
#    most `max_units` units of the text (UTF-8 bytes under a byte-level pre-tokenizer, characters
#    otherwise), and the units of all tokens add up to at least the text's, so a text of U units is
#    at least ceil(U / max_units) tokens. For SmolLM2 `max_units` is 81 (its longest token is a
#    newline and 80 spaces): a prompt over 81 x the context in bytes is refused without tokenizing
#    any of it. The bound is only derived where it holds, see `token_bound`.
# 2. Counting in chunks (`CHUNK_CHARS`, cut where the pre-tokenizers of the byte-level BPE families
#    split anyway: before a newline that follows a letter or digit) with an early stop, for a text
#    larger than `LIKELY_CHARS_PER_TOKEN` x the limit: what real text of that size would take. The
#    sum of the chunks' counts is the whole text's count when the cuts are at piece boundaries; a
#    cut elsewhere can change it by a few tokens, so a refusal needs the sum past the limit by
#    `CUT_SLACK_TOKENS` per cut and 1/64 of the limit. A text that passes is then tokenized whole,
#    as it always was: the engine's prompt is exactly the tokenizer's encoding of the text.

CHUNK_CHARS = 1 << 16
EXACT_BELOW_CHARS = 1 << 18  # up to 256 K characters (~0.1 s) a prompt is counted exactly, fitting or not
LIKELY_CHARS_PER_TOKEN = 8  # English ~4, code ~3, base64 ~2.5: 8 is twice what a fitting text needs
CUT_SLACK_TOKENS = 8


class PromptOverLimit(Exception):
    """The rendered prompt holds `at_least` tokens or more, not fewer than the limit; `counted`
    says whether that is a count of tokens (False: the proven bound, nothing was tokenized)."""

    def __init__(self, at_least: int, limit: int, counted: bool, chars: int):
        super().__init__(f"the prompt is at least {at_least} tokens; the limit is {limit}")
        self.at_least, self.limit, self.counted, self.chars = at_least, limit, counted, chars


@dataclass(frozen=True, slots=True)
class TokenBound:
    """Every token of this tokenizer stands for at most `max_units` units of the text it encodes:
    UTF-8 bytes (`unit == "bytes"`) or characters."""

    unit: str
    max_units: int

    def units(self, text: str) -> int:
        if self.unit == "chars" or text.isascii():  # isascii is O(1) on CPython's compact strings
            return len(text)
        step = 1 << 20  # a 1 MB slice at a time, not a copy of the whole text
        return sum(len(text[i:i + step].encode("utf-8", "surrogatepass")) for i in range(0, len(text), step))

    def at_least(self, text: str) -> int:
        return math.ceil(self.units(text) / self.max_units)


# Parts of a tokenizer that keep every unit of the text (a normalizer that only adds or replaces
# one character by one or more; pre-tokenizers that split without dropping anything).
_KEEPING_NORMALIZERS = {"Prepend"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def token_bound(tokenizer) -> TokenBound | None:
    """The proven bound for `tokenizer` (mlx-lm's wrapper or a Hugging Face tokenizer), or None where
    its definition does not guarantee one. It holds for a BPE model (each token is one vocabulary
    entry covering its own string of the text; no `fuse_unk`, which would let one unknown token
    cover any number of characters), whose normalizer and pre-tokenizers never drop part of the
    text (`_KEEPING_*`, a one-character `Replace`, a `Split` that keeps its matches), and whose added
    tokens do not strip whitespace around them (`lstrip`/`rstrip` would let one token absorb a run of
    spaces). Under a byte-level pre-tokenizer every vocabulary character is one byte of the text."""
    backend = None
    for candidate in (tokenizer, getattr(tokenizer, "_tokenizer", None)):  # HF's, or inside mlx-lm's wrapper
        backend = getattr(candidate, "backend_tokenizer", None)
        if backend is not None:
            break
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, ValueError, TypeError):
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("fuse_unk") or not isinstance(model.get("vocab"), dict):
        return None
    if not _keeps_all(spec.get("normalizer"), "normalizers", _KEEPING_NORMALIZERS):
        return None
    pre = spec.get("pre_tokenizer")
    if not _keeps_all(pre, "pretokenizers", _KEEPING_PRE_TOKENIZERS):
        return None
    byte_level = "ByteLevel" in json.dumps(pre) if pre else False
    longest = max((len(token) for token in model["vocab"]), default=1)
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return None
        content = added.get("content") or ""
        longest = max(longest, len(content.encode("utf-8")) if byte_level else len(content))
    return TokenBound("bytes" if byte_level else "chars", max(1, longest))


def _keeps_all(part, list_key: str, keeping: set[str]) -> bool:
    if part is None:
        return True
    kind = part.get("type")
    if kind == "Sequence":
        return all(_keeps_all(p, list_key, keeping) for p in part.get(list_key) or [])
    if kind == "Replace":  # one character for one or more: ' ' -> '▁'
        pattern = part.get("pattern") or {}
        return len(pattern.get("String") or "") == 1 and len(part.get("content") or "") >= 1
    if kind == "Split":
        return str(part.get("behavior", "")).lower() != "removed"
    return kind in keeping


def encode_within(tokenizer, text: str, limit: int | None, bound: TokenBound | None = None,
                  **encode_kwargs) -> list[int]:
    """`tokenizer.encode(text, **encode_kwargs)`, or `PromptOverLimit` for a text of `limit` tokens
    or more, found by the proven bound or by counting in chunks before most of a huge text is
    tokenized (see above)."""
    if limit is None or len(text) <= EXACT_BELOW_CHARS:
        return list(tokenizer.encode(text, **encode_kwargs))
    if bound is not None:
        at_least = bound.at_least(text)
        if at_least >= limit:
            raise PromptOverLimit(at_least, limit, counted=False, chars=len(text))
    if len(text) > LIKELY_CHARS_PER_TOKEN * limit:
        _count_in_chunks(tokenizer, text, limit, encode_kwargs)
    return list(tokenizer.encode(text, **encode_kwargs))


def _count_in_chunks(tokenizer, text: str, limit: int, encode_kwargs: dict) -> None:
    """Raises `PromptOverLimit` once the chunks counted so far are past `limit` by more than what
    their cuts could have added."""
    counted, start, cuts = 0, 0, 0
    margin = limit // 64
    while start < len(text):
        end = _cut(text, start + CHUNK_CHARS) if start + CHUNK_CHARS < len(text) else len(text)
        counted += len(tokenizer.encode(text[start:end], **encode_kwargs))
        start = end
        cuts += start < len(text)
        if counted - cuts * CUT_SLACK_TOKENS - margin >= limit:
            raise PromptOverLimit(counted - cuts * CUT_SLACK_TOKENS - margin, limit, counted=True, chars=len(text))


def _cut(text: str, near: int) -> int:
    """A cut at or before `near` (and past half a chunk before it): before a newline that follows a
    letter or digit, else before a space that does, else at `near`."""
    low = near - CHUNK_CHARS // 2
    for mark in ("\n", " "):
        at = text.rfind(mark, low, near)
        while at > low:
            if text[at - 1].isalnum():
                return at
            at = text.rfind(mark, low, at)
    return near

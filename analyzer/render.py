"""Rendered level: a request as the server's chat template would render it,
without the generation prompt (the next request legitimately replaces it).

A rendering is a list of segments: message contents (the very string
objects of the request, so unchanged messages cost nothing to compare or to
count) and the template's literal text between them. Two renderers:

- `TemplateRenderer`: a real Jinja chat template (`--template FILE.jinja`
  or `--model DIR` -> tokenizer_config.json's `chat_template`), in an
  environment like Hugging Face's (`trim_blocks`, `lstrip_blocks`, a
  `tojson` that keeps key order, `raise_exception`), honouring `tools` and
  `chat_template_kwargs`. Speed trick: contents are replaced by short
  sentinels before rendering and spliced back after, so the template only
  ever handles a few kB however long the prompt. Contents a template might
  inspect (think/tool markers) are passed through unchanged, and leading or
  trailing whitespace stays outside the sentinel so `strip`/`trim` behave.
- `GenericRenderer` (no template given), ChatML-like and documented in
  docs/ANALYZER.md: tools block first, then `<|im_start|>{role}\\n{body}<|im_end|>\\n`
  per message, with reasoning as `<think>…</think>` and tool calls as JSON.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from analyzer.canon import flatten_content, messages_of, strip_ignored
from analyzer.template_worker import TemplateBudgetError, shared_worker
from prefixtrace.common.bounded_read import read_regular_text
from prefixtrace.common.errors import InvalidRequest
from recorder.renderers import MAX_TEMPLATE_CHARS, MAX_TOKENIZER_BYTES
from prefixtrace.wire.normalize import template_message

START, END = "<|im_start|>", "<|im_end|>\n"
HEAD = -1  # owner of segments before the first message (tools, template preamble)
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")
# Contents containing these are rendered as they are: templates look into them.
_SENSITIVE = ("<think>", "</think>", "<tool_response>", "</tool_response>", "<tool_call>", "\ue000", "\ue001")


class RenderError(InvalidRequest):
    """The template refused the request (e.g. a system message not at the start)."""


@dataclass
class Rendered:
    """`segments[i]` belongs to message `owners[i]` (HEAD = before any).
    `kinds[i]` is "content", "reasoning" or "" (template literal)."""

    segments: list[str]
    owners: list[int]
    kinds: list[str]
    renderer: str
    num_messages: int = 0
    roles: list[str] = field(default_factory=list)
    # What the template adds after the messages when it asks the model to answer (the generation
    # prompt, e.g. "<|im_start|>assistant\n"): part of the prompt the server counts and caches, not
    # of the comparison (the next request replaces it with the reply). "" for the generic renderer.
    generation: str = ""

    @cached_property
    def text(self) -> str:
        return "".join(self.segments)

    def locate(self, offset: int) -> int:
        """Message index at char `offset`: the owner of the segment there;
        template text between messages belongs to the message it introduces."""
        pos = 0
        for seg, owner in zip(self.segments, self.owners):
            pos += len(seg)
            if offset < pos:
                return owner
        return self.num_messages - 1 if self.num_messages else HEAD

    def reasoning(self) -> set[tuple[int, str]]:
        return {(o, s) for s, o, k in zip(self.segments, self.owners, self.kinds) if k == "reasoning"}


def _dumps(value: Any) -> str:
    return json.dumps(strip_ignored(value), ensure_ascii=False)


class GenericRenderer:
    name = "generic-chatml"

    def render(self, body: Any) -> Rendered:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise InvalidRequest("request has no \"messages\" list")
        out = Rendered([], [], [], self.name)
        add = lambda s, o, k="": (out.segments.append(s), out.owners.append(o), out.kinds.append(k)) if s else None
        if body.get("tools"):
            add(f"{START}tools\n{_dumps(body['tools'])}{END}", HEAD)
        messages = messages_of(body)
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict):
                raise InvalidRequest(f"message {i} is not an object")
            msg = template_message(msg)  # as servers hand it to a template (null content, developer, arguments)
            role = str(msg.get("role", ""))
            out.roles.append(role)
            add(f"{START}{role}{' name=' + str(msg['name']) if msg.get('name') else ''}\n", i)
            reasoning = next((msg[k] for k in ("reasoning_content", "reasoning") if isinstance(msg.get(k), str)), "")
            if reasoning:
                add("<think>\n", i)
                add(reasoning, i, "reasoning")
                add("\n</think>\n", i)
            content = flatten_content(msg.get("content"))
            if isinstance(content, str):
                add(content, i, "content")
            elif content is not None:
                add(_dumps(content), i)
            if msg.get("tool_calls"):
                add(("\n" if content else "") + _dumps(msg["tool_calls"]), i)
            add(END, i)
        out.num_messages = len(messages)
        return out


class TemplateRenderer:
    """A Jinja chat template. `special` holds bos_token/eos_token etc."""

    def __init__(self, source: str, name: str, special: dict[str, str] | None = None):
        if len(source) > MAX_TEMPLATE_CHARS:
            raise InvalidRequest(f"cannot load chat template {name}: {len(source):,} characters, over the "
                                 f"{MAX_TEMPLATE_CHARS:,} a chat template may have")
        # Rendered in a bounded child process (analyzer/template_worker.py): the template may come from
        # a recording or an upstream, and a template is a program.
        self.worker = shared_worker(source, name)
        self.name = name
        self.special = special or {}
        self.generation_prompt = True  # also render the generation prompt: the server counts it
        # Per message object: its skeleton and the sentinel ids it uses.
        # Messages repeat from turn to turn as the same objects (see load.py).
        self._skeletons: dict[int, tuple[Any, Any, list[int]]] = {}
        self._originals: list[tuple[str, str]] = []  # sentinel id -> (string, kind)

    @classmethod
    def from_file(cls, path: str | Path) -> TemplateRenderer:
        p = Path(path)
        return cls(read_regular_text(p, MAX_TEMPLATE_CHARS, "template"), f"template:{p.name}")

    @classmethod
    def from_model_dir(cls, path: str | Path) -> TemplateRenderer:
        p = Path(path)
        config_text = read_regular_text(p / "tokenizer_config.json", MAX_TOKENIZER_BYTES, "model file")
        try:
            config = json.loads(config_text)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequest(f"cannot read {p / 'tokenizer_config.json'}: not valid JSON") from exc
        if not isinstance(config, dict):
            raise InvalidRequest(f"cannot read {p / 'tokenizer_config.json'}: not a JSON object")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not template and (p / "chat_template.jinja").is_file():
            template = read_regular_text(p / "chat_template.jinja", MAX_TEMPLATE_CHARS, "template")
        if not isinstance(template, str) or not template:
            raise InvalidRequest(f"{p} has no chat_template")
        special = {}
        for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = config.get(k)
            special[k] = v.get("content", "") if isinstance(v, dict) else (v or "")
        return cls(template, f"model:{p.name}", special)

    def render(self, body: Any) -> Rendered:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise InvalidRequest("request has no \"messages\" list")
        messages = messages_of(body)
        owner_of: dict[int, int] = {}
        skeleton = []
        for i, m in enumerate(messages):
            skel, sids = self._skeleton(m, i)
            skeleton.append(skel)
            for sid in sids:
                owner_of[sid] = i
        kwargs = body.get("chat_template_kwargs") if isinstance(body.get("chat_template_kwargs"), dict) else {}
        tools = strip_ignored(body.get("tools")) or None
        # Both renderings (without and with the generation prompt) in one round trip to the worker.
        texts = self._render_texts(skeleton, tools, kwargs, (False, True) if self.generation_prompt else (False,))
        text = texts[0]
        if isinstance(text, RenderError):
            raise RenderError(f"{text.message}{self._where(skeleton, tools, kwargs)}")
        out = Rendered([], [], [], self.name, len(messages), [str(m.get("role", "")) for m in messages])
        out.generation = self._generation(text, texts[1] if len(texts) > 1 else None)
        parts = _SENTINEL_RE.split(text)
        pending: list[str] = []  # literal text waiting for the owner of the next content
        for j, part in enumerate(parts):
            if j % 2 == 0:
                if part:
                    pending.append(part)
                continue
            sid = int(part)
            s, kind = self._originals[sid]
            owner = owner_of.get(sid, HEAD)
            for lit in pending:
                out.segments.append(lit), out.owners.append(owner), out.kinds.append("")
            pending = []
            out.segments.append(s), out.owners.append(owner), out.kinds.append(kind)
        last = len(messages) - 1 if messages else HEAD
        for lit in pending:
            out.segments.append(lit), out.owners.append(last), out.kinds.append("")
        return out

    @staticmethod
    def _generation(text: str, full: str | RenderError | None) -> str:
        """The generation prompt the server appends (rendered with `add_generation_prompt`, minus the
        rendering without it); "" when the template adds none or renders the rest differently too."""
        if not isinstance(full, str):
            return ""
        suffix = full[len(text):] if full.startswith(text) else ""
        return "" if _SENTINEL_RE.search(suffix) else suffix

    def _render_texts(self, skeleton: list, tools: Any, kwargs: dict,
                      generations: tuple[bool, ...]) -> list[str | RenderError]:
        """The template's text for each `add_generation_prompt` value, or the RenderError it gave."""
        context = {**self.special, **kwargs, "messages": skeleton, "tools": tools}
        try:
            replies = self.worker.render(context, generations)
        except TemplateBudgetError as exc:
            return [RenderError(exc.message)] * len(generations)
        out: list[str | RenderError] = []
        for reply in replies:
            if "error" not in reply:
                out.append(reply["text"])
            elif reply.get("raised"):
                out.append(RenderError(f"template: {reply['error']}"))
            else:
                out.append(RenderError(f"template {self.name} failed: {reply['error'][:300]}"))
        return out

    def _render_text(self, skeleton: list, tools: Any, kwargs: dict) -> str:
        text = self._render_texts(skeleton, tools, kwargs, (False,))[0]
        if isinstance(text, RenderError):
            raise text
        return text

    def _where(self, skeleton: list, tools: Any, kwargs: dict) -> str:
        """", at message K (role)": the shortest prefix of the messages that the template refuses
        (binary search, only paid when a render fails). Empty when even one message fails or all do."""
        lo, hi = 1, len(skeleton)  # the full list fails; find the smallest failing prefix length
        try:
            self._render_text(skeleton[:1], tools, kwargs)
        except RenderError:
            return " (at message 0)" if len(skeleton) == 1 else ""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            try:
                self._render_text(skeleton[:mid], tools, kwargs)
                lo = mid
            except RenderError:
                hi = mid
        k = hi - 1
        role = skeleton[k].get("role") if isinstance(skeleton[k], dict) else None
        return f" (at message {k}, {role})"

    def _skeleton(self, msg: Any, index: int) -> tuple[Any, list[int]]:
        hit = self._skeletons.get(id(msg))
        if hit is not None and hit[0] is msg:
            return hit[1], hit[2]
        if not isinstance(msg, dict):
            raise InvalidRequest(f"message {index} is not an object")
        # What servers do before the template (prefixtrace/wire/normalize.py), then our flattening.
        out = dict(template_message(msg))
        out["content"] = flatten_content(out.get("content"))
        sids = []
        for key, kind in (("content", "content"), ("reasoning_content", "reasoning"), ("reasoning", "reasoning")):
            value = out.get(key)
            if not isinstance(value, str) or not value.strip() or any(s in value for s in _SENSITIVE):
                continue
            lead = value[: len(value) - len(value.lstrip())]
            trail = value[len(value.rstrip()):]
            # Keep the very object when there is nothing to cut: identity makes counting and comparing free.
            core = value[len(lead): len(value) - len(trail)] if lead or trail else value
            sid = len(self._originals)
            self._originals.append((core, kind))
            out[key] = f"{lead}\ue000{sid}\ue001{trail}"
            sids.append(sid)
        if len(self._skeletons) > 200_000:  # bound the cache on huge runs; it refills from live messages
            self._skeletons.clear()
        self._skeletons[id(msg)] = (msg, out, sids)
        return out, sids


def recorded_renderer(info) -> TemplateRenderer:
    """The renderer the proxy recorded (recorder/renderers.py RendererInfo): its template and specials."""
    if not info.chat_template:
        raise InvalidRequest(f"the recorded renderer of {info.model} has no chat template")
    return TemplateRenderer(info.chat_template, f"recorded:{info.model}", dict(info.special))


def make_renderer(template: str | Path | None = None, model: str | Path | None = None):
    """The renderer for CLI-style options: a template file, a model dir, or generic."""
    if template is not None:
        return TemplateRenderer.from_file(template)
    if model is not None:
        return TemplateRenderer.from_model_dir(model)
    return GenericRenderer()


def render_request(body: Any, renderer=None) -> Rendered:
    """Renders one request body (generic renderer unless one is given)."""
    return (renderer or GenericRenderer()).render(body)

"""Render policies: rewrite a chat request's messages before the chat template
sees them, so that the rendered prompt keeps extending the previous turn's
(docs/RENDER_POLICIES.md, issue 9).

Two template-made cache breaks are handled (the analyzer's causes
`system_fold` and `thinking_strip`, docs/ANALYZER.md):

- **Mid-conversation system messages** (`mid_system`; `developer` counts as
  `system`). `fold` merges them into the head, as many servers do: the head
  changes, so every such message re-prefills the whole conversation.
  `inline` keeps them where they were sent. A template that renders a later
  system message in place gets it unchanged. A template that raises on it
  (Qwen3.5) or folds it into the head itself cannot be told otherwise, so the
  message is rewritten as a user-role message whose content starts with
  `SYSTEM_NOTE_HEADER`: every chat template renders a user message in place,
  and the header tells the model (and a reader of the prompt) that this is a
  system instruction, not something the user typed. The note counts as a
  harness notice below, so it never starts a new agent loop. `strict` rejects
  the request with a 400 naming the message index.
- **Reasoning retention** (`thinking_retention`). Templates like Qwen3's keep
  an assistant turn's reasoning only after the last user-role message, so a
  harness notice sent as a user message (todo update, subagent result,
  background-job notice) strips the reasoning of the loop so far and the
  prompt shrinks. `template` leaves this alone. `all` sets
  `preserve_thinking=True` (every reasoning stays). `loop` sets
  `preserve_thinking=True` and removes the reasoning itself: it keeps the
  reasoning of the current agent loop (after the last *real* user message)
  and drops the rest, which is what the template does when notices are not
  mistaken for queries. The guard: walking the loop's assistant turns in
  order, once the reasoning kept since the last cut exceeds `guard_tokens`,
  the reasoning of every loop turn up to that one is dropped and counting
  restarts. The rule reads only the messages up to each turn, so a cut
  happens once (in the first request that contains the turn crossing the
  guard) and every later request renders the same prefix: append-only again.
  `loop` and `all` need a template that honours `preserve_thinking`; for one
  that does not, the template's own rule applies and the per-turn record says
  so.

Real user message vs harness notice (`NoticeRule`): a user-role message is a
notice when its `name` is one of `NOTICE_NAMES` ("harness", "notice"), or
its content matches the notice regex at its start (`DEFAULT_NOTICE_PATTERN`,
replaceable with `--notice-pattern`), or it carries tool results
(`<tool_response>`, as Qwen templates treat it). Everything else is real.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from prefixtrace.common.errors import EngineError, InvalidRequest
from prefixtrace.wire.request import joined_text as _text

log = logging.getLogger("prefixtrace.engine")

MID_SYSTEM_POLICIES = ("fold", "inline", "strict")
THINKING_RETENTIONS = ("loop", "template", "all")
DEFAULT_MID_SYSTEM = "inline"
DEFAULT_THINKING_RETENTION = "loop"
DEFAULT_GUARD_TOKENS = 30_000
SYSTEM_NOTE_HEADER = "[system message]"
NOTICE_NAMES = frozenset({"harness", "notice"})
# Openings harnesses use for notices they send as user messages: a tag such as
# <system-reminder>, <todo…>, <subagent…>, <background…>, <job…>, <notice…>,
# <task-notification>, or a bracketed label such as [todo update] / [notice].
DEFAULT_NOTICE_PATTERN = (
    r"\s*(?:<(?:system[-_]reminder|todo|subagent|background|job|notice|task[-_]notification)[^>]*>"
    r"|\[(?:todo|subagent|background|job|notice|system message)[^\]]*\])"
)
HEAD_ROLES = ("system", "developer")
REASONING_KEYS = ("reasoning_content", "reasoning")


@dataclass(slots=True)
class NoticeRule:
    """Which user-role messages are harness notices rather than real user turns."""

    pattern: str = DEFAULT_NOTICE_PATTERN
    names: frozenset[str] = NOTICE_NAMES
    _regex: re.Pattern = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self._regex = re.compile(self.pattern)
        except re.error as exc:
            raise EngineError(f"--notice-pattern is not a valid regular expression: {exc}") from exc

    def is_notice(self, message: dict) -> bool:
        if message.get("role") != "user":
            return False
        if message.get("name") in self.names:
            return True
        text = _text(message.get("content"))
        return text.lstrip().startswith("<tool_response>") or bool(self._regex.match(text))


@dataclass(slots=True)
class RenderPolicy:
    """What the engine does to a request's messages before the template renders them."""

    mid_system: str = DEFAULT_MID_SYSTEM
    thinking_retention: str = DEFAULT_THINKING_RETENTION
    guard_tokens: int = DEFAULT_GUARD_TOKENS
    notices: NoticeRule = field(default_factory=NoticeRule)

    def __post_init__(self) -> None:
        if self.mid_system not in MID_SYSTEM_POLICIES:
            raise EngineError(f"mid_system must be one of {'|'.join(MID_SYSTEM_POLICIES)}, got {self.mid_system!r}")
        if self.thinking_retention not in THINKING_RETENTIONS:
            raise EngineError(
                f"thinking_retention must be one of {'|'.join(THINKING_RETENTIONS)}, got {self.thinking_retention!r}")
        if self.guard_tokens < 1:
            raise EngineError(f"thinking retention guard must be at least 1 token, got {self.guard_tokens}")

    def describe(self) -> str:
        return (f"mid-system-policy {self.mid_system}, thinking-retention {self.thinking_retention} "
                f"(guard {self.guard_tokens} tokens)")


@dataclass(slots=True)
class TemplateTraits:
    """What a chat template does, found by rendering three tiny probe conversations.

    Args:
        inline_system: a later system message renders after the message before it (not raised, not folded).
        preserve_thinking: `preserve_thinking=True` renders the reasoning of an assistant turn before the last user message.
    """

    inline_system: bool = False
    preserve_thinking: bool = False

    @classmethod
    def probe(cls, render: Callable[..., str]) -> "TemplateTraits":
        """`render(messages, **template_kwargs) -> text` renders without a generation prompt."""
        traits = cls()
        try:
            text = render([{"role": "system", "content": "probe-s0"}, {"role": "user", "content": "probe-u1"},
                           {"role": "system", "content": "probe-s2"}])
            traits.inline_system = text.find("probe-s2") > text.find("probe-u1") >= 0
        except Exception:  # the template raised: it refuses later system messages
            traits.inline_system = False
        convo = [{"role": "user", "content": "probe-u1"},
                 {"role": "assistant", "content": "probe-a1", "reasoning_content": "probe-r1"},
                 {"role": "user", "content": "probe-u2"}]
        try:
            traits.preserve_thinking = "probe-r1" in render(convo, preserve_thinking=True)
        except Exception:
            traits.preserve_thinking = False
        return traits

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "TemplateTraits":
        return cls.probe(lambda messages, **kw: tokenizer.apply_chat_template(
            messages, add_generation_prompt=False, tokenize=False, **kw))


@dataclass(slots=True)
class Applied:
    messages: list[dict]
    template_kwargs: dict
    record: dict  # what was applied, for turn.render["policy"]


class _TokenCounter:
    """Token counts of reasoning strings, memoised (the same strings recur every turn)."""

    def __init__(self, count: Callable[[str], int], size: int = 4096):
        self._count, self._size = count, size
        self._memo: OrderedDict[str, int] = OrderedDict()

    def __call__(self, text: str) -> int:
        n = self._memo.get(text)
        if n is None:
            n = self._memo[text] = self._count(text)
            if len(self._memo) > self._size:
                self._memo.popitem(last=False)
        else:
            self._memo.move_to_end(text)
        return n


class BoundPolicy:
    """A RenderPolicy bound to one template's traits and one tokenizer's counts."""

    def __init__(self, policy: RenderPolicy, traits: TemplateTraits, count_tokens: Callable[[str], int]):
        self.policy, self.traits = policy, traits
        self.count = _TokenCounter(count_tokens)

    def apply(self, messages: list[dict], chat_template_kwargs: dict | None = None) -> Applied:
        """Messages and template kwargs to render, and the record of what was done.
        Unchanged messages are passed through as the same objects."""
        kwargs = dict(chat_template_kwargs or {})
        out, notice, record = self._mid_system(messages)
        record.update(self._retention(out, notice, kwargs))
        return Applied(out, kwargs, record)

    # --- mid-conversation system messages -----------------------------------

    def _mid_system(self, messages: list[dict]) -> tuple[list[dict], list[bool], dict]:
        policy = self.policy.mid_system
        msgs = [dict(m, role="system") if m.get("role") == "developer" else m for m in messages]
        head = 0
        while head < len(msgs) and msgs[head].get("role") == "system":
            head += 1
        if head > 1:  # several leading system messages: one head, as every template renders it first
            msgs = [{**msgs[0], "content": "\n\n".join(_text(m.get("content")) for m in msgs[:head])}] + msgs[head:]
            head = 1
        later = [i for i in range(head, len(msgs)) if msgs[i].get("role") == "system"]
        record: dict[str, Any] = {"mid_system": policy, "mid_system_messages": len(later)}
        if later and policy == "strict":
            # Report the index the client sent (leading system messages were merged above).
            sent = [i for i, m in enumerate(messages) if m.get("role") in HEAD_ROLES]
            first_later = next(i for i in sent if any(m.get("role") not in HEAD_ROLES for m in messages[:i]))
            raise InvalidRequest(
                f"messages[{first_later}] is a {messages[first_later].get('role')} message after the conversation "
                "started; this server runs with --mid-system-policy strict (send it as a user message, or put it "
                "in the leading system message)", param=f"messages[{first_later}]")
        notice = [self.policy.notices.is_notice(m) for m in msgs]
        if not later:
            return msgs, notice, record
        if policy == "fold":
            texts = [_text(msgs[i].get("content")) for i in later]
            if head:
                merged = {**msgs[0], "content": "\n\n".join([_text(msgs[0].get("content"))] + texts)}
            else:
                merged = {"role": "system", "content": "\n\n".join(texts)}
            keep = [i for i in range(head, len(msgs)) if i not in set(later)]
            record["mid_system_as"] = "head"
            return [merged] + [msgs[i] for i in keep], [False] + [notice[i] for i in keep], record
        if self.traits.inline_system:
            record["mid_system_as"] = "in_place"
            return msgs, notice, record
        record["mid_system_as"] = "user_note"
        msgs = list(msgs)
        for i in later:
            msgs[i] = {"role": "user", "content": f"{SYSTEM_NOTE_HEADER}\n{_text(msgs[i].get('content'))}"}
            notice[i] = True  # a system update does not start a new agent loop
        return msgs, notice, record

    # --- reasoning retention -------------------------------------------------

    def _retention(self, msgs: list[dict], notice: list[bool], kwargs: dict) -> dict:
        """Edits `msgs` (copy-on-write) and `kwargs` in place; returns the record."""
        mode = self.policy.thinking_retention
        has_reasoning = [m.get("role") == "assistant" and any(m.get(k) for k in REASONING_KEYS) for m in msgs]
        record: dict[str, Any] = {"thinking_retention": mode, "notices": sum(notice)}
        if "preserve_thinking" in kwargs:
            record["thinking_retention"] = "client"  # the request's own chat_template_kwargs win
            return record
        if mode == "template" or not any(has_reasoning):
            return record
        if not self.traits.preserve_thinking:
            record["thinking_retention"] = "template"
            record["fallback"] = "the template ignores preserve_thinking"
            return record
        kwargs["preserve_thinking"] = True
        if mode == "all":
            record["reasoning_kept"] = sum(has_reasoning)
            return record
        real = [i for i, m in enumerate(msgs) if m.get("role") == "user" and not notice[i]]
        loop_start = real[-1] if real else -1
        # The template's own rule: reasoning survives only after the last user-role message.
        template_cut = max((i for i, m in enumerate(msgs) if m.get("role") == "user"
                            and not _text(m.get("content")).lstrip().startswith("<tool_response>")), default=-1)
        strip = {i for i in range(max(loop_start, 0)) if has_reasoning[i]}
        kept_tokens, cuts, since_cut = 0, 0, []
        for i in range(loop_start + 1, len(msgs)):
            if not has_reasoning[i]:
                continue
            since_cut.append(i)
            kept_tokens += sum(self.count(msgs[i][k]) for k in REASONING_KEYS if isinstance(msgs[i].get(k), str))
            if kept_tokens > self.policy.guard_tokens:
                strip.update(since_cut)
                since_cut, kept_tokens, cuts = [], 0, cuts + 1
        for i in strip:
            msgs[i] = {k: v for k, v in msgs[i].items() if k not in REASONING_KEYS}
        kept = [i for i in since_cut]
        record.update({
            "reasoning_kept": len(kept),
            "reasoning_stripped": len(strip),
            "kept_over_template": sum(1 for i in kept if i < template_cut),
            "retained_reasoning_tokens": kept_tokens,
            "guard_cuts": cuts,
        })
        return record


class PolicyAnalyzerRenderer:
    """An analyzer renderer (duck-typed: `.name`, `.render(body)`) that applies a
    policy first, so `analyzer.analyze(..., renderer=...)` sees the prompt the
    engine would render. The payload level still sees the bodies as sent."""

    def __init__(self, inner, policy: RenderPolicy, count_tokens: Callable[[str], int] | None = None):
        self.inner = inner
        self.name = f"{inner.name}+{policy.mid_system}/{policy.thinking_retention}"
        traits = TemplateTraits.probe(lambda messages, **kw: inner.render(
            {"messages": messages, "chat_template_kwargs": kw}).text)
        self.bound = BoundPolicy(policy, traits, count_tokens or (lambda s: len(s.split())))

    def render(self, body: Any):
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return self.inner.render(body)
        applied = self.bound.apply(body["messages"], body.get("chat_template_kwargs"))
        return self.inner.render({**body, "messages": applied.messages, "chat_template_kwargs": applied.template_kwargs})

"""The model's output text → reply events: answer text, reasoning and tool calls, separated as the model
family writes them (docs/TOOLS.md).

The family's format comes from mlx-lm: `TokenizerWrapper` names the tool-call markers and parser it
inferred from the chat template (`mlx_lm/tool_parsers/`: json_tools for Hermes/Qwen `<tool_call>{json}
</tool_call>`, qwen3_coder, mistral, pythonic, …) and the thinking markers (`<think>…</think>`);
mlx-lm's `TextStateMachine` splits streamed text at those markers and holds back text that may be the
start of one. A tokenizer with no tool format (SmolLM2, the tiny fixture without a tool template) gets
the Hermes format, the one most small models were tuned on.

Events come out as the text streams: reasoning and answer text at once, a call once its end marker is
seen (the family's parser needs the whole call) as a `ToolCallStart` and one `ToolCallArgsDelta`. A call
whose text the parser cannot read is returned as answer text, so nothing the model wrote is lost.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Callable

from mlx_lm.generate import TextStateMachine

from prefixtrace.wire.events import ContentDelta, ReasoningDelta, ReplyEvent, ToolCallArgsDelta, ToolCallStart

log = logging.getLogger("prefixtrace.reply")

FALLBACK_TOOL_PARSER = "json_tools"  # Hermes `<tool_call>{"name": …, "arguments": …}</tool_call>`
# The head of a Hermes call as the grammar writes it: the name, then the arguments object (matched once
# the arguments' first character is out, so the space before them is never part of them).
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
# What may still close the call object after its arguments: held back while streaming them.
_HERMES_TAIL = re.compile(r'\s*\}?\s*$')


@dataclass(frozen=True)
class ReplyFormat:
    """How one model family marks reasoning and tool calls in its output."""

    tool_parser_name: str
    tool_call_start: str
    tool_call_end: str
    parse_tool_call: Callable
    think_start: str | None = None
    think_end: str | None = None
    fallback: bool = False  # the tokenizer named no tool format; Hermes assumed

    @classmethod
    def hermes(cls, think_start: str | None = None, think_end: str | None = None, fallback: bool = True):
        module = importlib.import_module(f"mlx_lm.tool_parsers.{FALLBACK_TOOL_PARSER}")
        return cls(FALLBACK_TOOL_PARSER, module.tool_call_start, module.tool_call_end, module.parse_tool_call,
                   think_start, think_end, fallback)

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "ReplyFormat":
        """The format mlx-lm inferred for this tokenizer (a `TokenizerWrapper`), else Hermes."""
        think = (tokenizer.think_start, tokenizer.think_end) if getattr(tokenizer, "has_thinking", False) else (None, None)
        if getattr(tokenizer, "has_tool_calling", False) and tokenizer.tool_call_start:
            name = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type") or "inferred"
            return cls(name, tokenizer.tool_call_start, tokenizer.tool_call_end or "", tokenizer.tool_parser, *think)
        return cls.hermes(*think)

    def opens_reasoning(self, prompt_text: str) -> bool:
        """Whether the prompt leaves a reasoning block open (the template wrote `<think>` for the model),
        so the output starts as reasoning: mlx-lm's server decides its initial state the same way."""
        if not self.think_start:
            return False
        return prompt_text.rfind(self.think_start) > prompt_text.rfind(self.think_end)

    def state_machine(self, parse_tools: bool) -> TextStateMachine:
        transitions: dict[str, list] = {"normal": []}
        if self.think_start:
            transitions["normal"].append((self.think_start, "reasoning"))
            transitions["reasoning"] = [(self.think_end, "normal")]
        if parse_tools:
            transitions["normal"].append((self.tool_call_start, "tool"))
            if self.think_start:
                transitions["reasoning"].append((self.tool_call_start, "tool"))
            transitions["tool"] = [(self.tool_call_end, "normal")] if self.tool_call_end else []
        return TextStateMachine(transitions)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ReplyParser:
    """One reply's output text, fed as it streams, turned into reply events.

    Args:
        fmt: the model family's markers and tool parser.
        tools: the request's tools (some parsers read parameter types from them); None or [] with
            `parse_tools` False leaves call markers as plain text (tool_choice "none").
        reasoning: the output starts inside a reasoning block (see `ReplyFormat.opens_reasoning`).
        stream_arguments: a grammar forces the Hermes call (engine/constraints.py), so its text is known
            to be `{"name": N, "arguments": {…}}`: the call starts as soon as its name is out and the
            arguments stream as they are written. Free output is parsed whole, by the family's parser.
    """

    def __init__(self, fmt: ReplyFormat, *, tools: list | None = None, parse_tools: bool = True,
                 reasoning: bool = False, stream_arguments: bool = False):
        self.fmt = fmt
        self.tools = tools or None
        self._sm = fmt.state_machine(parse_tools)
        self._state = self._sm.make_state("reasoning" if reasoning and fmt.think_start else "normal")
        self._tool_text: str | None = None  # text of the call being read, while inside its markers
        self.num_calls = 0
        self.stream_arguments = stream_arguments and fmt.tool_parser_name == FALLBACK_TOOL_PARSER
        self._args_at: int | None = None  # streaming: where the arguments begin in the call's text
        self._args_sent = 0

    @property
    def made_tool_call(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> list[ReplyEvent]:
        self._state, segments = TextStateMachine.split(self._state, text)
        return self._events(segments)

    def finish(self) -> list[ReplyEvent]:
        """The output ended: what was held back, and a call left open (no end marker before EOS or
        max_tokens) read as far as it goes."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        events = self._events([(state, rest)])
        if self._tool_text is not None:
            events += self._close_call(closed=False)
        return events

    def _events(self, segments) -> list[ReplyEvent]:
        events: list[ReplyEvent] = []
        for state, text in segments:
            if state != "tool" and self._tool_text is not None:
                events += self._close_call()  # the end marker was matched
            if state == "tool":
                self._tool_text = (self._tool_text or "") + text
                if self.stream_arguments:
                    events += self._stream_call()
            elif not text:
                continue
            elif state == "reasoning":
                events.append(ReasoningDelta(text))
            else:
                events.append(ContentDelta(text))
        return events

    def _stream_call(self) -> list[ReplyEvent]:
        """A forced call, as it is written: the start once the name is complete, then the arguments
        except what may be the call object's closing brace."""
        events: list[ReplyEvent] = []
        text = self._tool_text
        if self._args_at is None:
            head = _HERMES_HEAD.match(text)
            if head is None:
                return events
            self._args_at, self._args_sent = head.end(), 0
            events.append(ToolCallStart(self.num_calls, new_call_id(), json.loads(head.group(1))))
        args = text[self._args_at:]
        safe = len(args) - len(_HERMES_TAIL.search(args).group(0))
        if safe > self._args_sent:
            events.append(ToolCallArgsDelta(self.num_calls, args[self._args_sent:safe]))
            self._args_sent = safe
        return events

    def _close_streamed_call(self) -> list[ReplyEvent]:
        args = self._tool_text[self._args_at:].rstrip()
        args = args[:-1].rstrip() if args.endswith("}") else args  # the call object's own brace
        events: list[ReplyEvent] = []
        if len(args) > self._args_sent:
            events.append(ToolCallArgsDelta(self.num_calls, args[self._args_sent:]))
        self._tool_text, self._args_at = None, None
        self.num_calls += 1
        return events

    def _close_call(self, closed: bool = True) -> list[ReplyEvent]:
        if self._args_at is not None:
            return self._close_streamed_call()
        text, self._tool_text = self._tool_text, None
        try:
            parsed = self.fmt.parse_tool_call(text, self.tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            events: list[ReplyEvent] = []
            for call in calls:
                name, arguments = call["name"], call.get("arguments", {})
                if not isinstance(name, str) or not name:
                    raise ValueError(f"tool name {name!r}")
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                events += [ToolCallStart(self.num_calls, call.get("id") or new_call_id(), name),
                           ToolCallArgsDelta(self.num_calls, arguments)]
                self.num_calls += 1
            return events
        except Exception as exc:  # the parsers raise ValueError, KeyError, TypeError, JSONDecodeError...
            log.info("tool call text not parseable as %s (%s: %s); returned as text",
                     self.fmt.tool_parser_name, type(exc).__name__, exc)
            return [ContentDelta(self.fmt.tool_call_start + text + (self.fmt.tool_call_end if closed else ""))]


def final_finish_reason(finish_reason: str, parser: ReplyParser) -> str:
    """OpenAI's finish_reason: a reply that stopped after calling tools ends with "tool_calls"."""
    return "tool_calls" if finish_reason == "stop" and parser.made_tool_call else finish_reason

"""What a request asks of the reply's shape: `tool_choice`, `response_format`, and the serve default
for small models (docs/TOOLS.md). Decides how the reply is parsed and which grammar, if any, the
row decodes under. Requests arrive here in OpenAI's terms (the Messages adapter translates).

tool_choice:
  * "auto" (or absent): the model decides; its calls are parsed.
  * "none": the tools stay in the prompt (the rendered prefix, and so the prefix cache, is the same
    as on the turns around it) but nothing is parsed as a call: whatever the model writes is text.
  * "required" / {"type": "function", "function": {"name": N}}: the reply is one call, to any of
    the tools / to N, decoded under a grammar, so its arguments validate against the tool's schema.
    Forced calls use the Hermes format (`<tool_call>{json}</tool_call>`), whatever the model's own
    format: the grammar writes it and the same reply's parser reads it back.

`--tool-choice-default required-after-user` (a test aid for small models, which rarely call a tool
on their own): a request with tools and no tool_choice (or "auto") whose last message is a user turn
is served as "required"; after a tool result the model answers freely, so an agent loop ends.
`required-until-tool-result` forces only while the conversation holds no tool result at all: a
harness that answers a reply cut at max_tokens with a user message of its own (Claude Code's "Output
token limit hit. Resume directly") would otherwise get a forced call again, and a small model that
never ends its free answer by itself would loop call, answer, cut, call... until the harness's bound.

A forced reply writes a bounded subset of what its schema accepts (`engine.grammar.GrammarLimits`:
strings, arrays and numbers the schema leaves unbounded get a bound, `--grammar-max-string`), so a
model that repeats itself inside a value still closes the call instead of decoding to max_tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from engine.grammar import DEFAULT_LIMITS, GrammarLimits
from engine.reply_parser import ReplyFormat
from prefixtrace.common.errors import InvalidRequest

TOOL_CHOICE_DEFAULTS = ("auto", "required-after-user", "required-until-tool-result")
log = logging.getLogger("prefixtrace.constraints")


@dataclass(slots=True)
class ReplyPlan:
    fmt: ReplyFormat
    parse_tools: bool
    processor: Any = None  # engine.grammar.GrammarProcessor, or None for free decoding
    forced: str | None = None  # "tool_call" | "json": what the grammar forces, for the record
    # The template left a reasoning block open (`ReplyFormat.opens_reasoning`): the output starts as
    # reasoning, and a forced reply's grammar closes it first.
    reasoning_open: bool = False


def parse_tool_choice(tool_choice: Any, tools: list | None) -> tuple[str, str | None]:
    """(mode, tool name) with mode "auto" | "none" | "required"; a 400 for anything else."""
    if tool_choice is None or tool_choice == "auto":
        return "auto", None
    if tool_choice in ("none", "required"):
        if tool_choice == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs at least one tool", param="tool_choice")
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidRequest("tool_choice.function.name must be a non-empty string", param="tool_choice")
        names = [((t.get("function") or {}).get("name")) for t in tools or [] if isinstance(t, dict)]
        if name not in names:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools {names}",
                                 param="tool_choice")
        return "required", name
    raise InvalidRequest("tool_choice must be 'auto', 'none', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")


def response_schema(response_format: Any) -> dict | None:
    """The JSON schema a `response_format` asks for (json_object: any object); None for text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise InvalidRequest("response_format must be an object", param="response_format")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.json_schema.schema must be an object", param="response_format")
        return schema
    raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                         param="response_format")


def after_user_turn(messages: list[dict]) -> bool:
    """The conversation's last message is a user turn, with no tool result since the last assistant
    message (a Messages tool_result followed by text translates to a tool message then a user one)."""
    return bool(messages) and messages[-1].get("role") == "user" and not _tool_since_assistant(messages)


def forced_by_default(tool_choice_default: str, messages: list[dict]) -> bool:
    """Whether serve's `--tool-choice-default` turns this request's "auto" into "required"."""
    if tool_choice_default == "required-after-user":
        return after_user_turn(messages)
    if tool_choice_default == "required-until-tool-result":
        return after_user_turn(messages) and not any(m.get("role") == "tool" for m in messages)
    return False


def _tool_since_assistant(messages: list[dict]) -> bool:
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return False
        if message.get("role") == "tool":
            return True
    return False


def plan_reply(*, fmt: ReplyFormat, grammar, tools: list | None, tool_choice: Any, response_format: Any,
               messages: list[dict], prompt_text: str, tool_choice_default: str = "auto",
               limits: GrammarLimits = DEFAULT_LIMITS) -> ReplyPlan:
    """How this request's reply is decoded and parsed. `grammar` is the engine's GrammarCompiler;
    `limits` bound what a forced reply may write where its schema does not (engine/grammar.py)."""
    mode, name = parse_tool_choice(tool_choice, tools)
    schema = response_schema(response_format)
    by_default = mode == "auto" and bool(tools) and forced_by_default(tool_choice_default, messages)
    # A template that opened a reasoning block for the model: a forced reply closes it first.
    reasoning_open = fmt.opens_reasoning(prompt_text)
    prefix = (fmt.think_end + "\n\n") if reasoning_open else ""
    if mode == "required" or by_default:
        hermes = fmt if fmt.tool_parser_name == "json_tools" else ReplyFormat.hermes(fmt.think_start, fmt.think_end)
        try:
            processor = grammar.tool_call(tools, name, hermes.tool_call_start, hermes.tool_call_end, prefix=prefix,
                                          limits=limits)
        except InvalidRequest as exc:
            if not by_default:
                raise
            # The client asked for nothing: a schema llguidance cannot compile leaves the reply free.
            log.warning("tool_choice default not applied: %s", exc.message)
        else:
            return ReplyPlan(hermes, True, processor, "tool_call", reasoning_open)
    if schema is not None:
        return ReplyPlan(fmt, False, grammar.json_schema(schema, prefix=prefix, limits=limits), "json", reasoning_open)
    return ReplyPlan(fmt, parse_tools=mode == "auto" and bool(tools), reasoning_open=reasoning_open)

"""Codex: `$CODEX_HOME/sessions/YYYY/MM/DD/rollout-<time>-<session id>.jsonl` (CODEX_HOME: ~/.codex).

What it holds: a `session_meta` line (`id`, `cwd`, `cli_version`, the model's default base
instructions), `turn_context` lines (model,
effort, sandbox), `token_usage_record` lines (one per call, as it completes, with its `usage`),
`event_msg` lines (UI events, `token_count`) and one `response_item` line per item of the
conversation, in the Responses API's own shape and with the ids Codex sends: `message` (developer /
user / assistant), `reasoning`, `function_call`, `function_call_output`, … Items a call returned are
written after it; everything before them is that call's `input`. A `compacted` line (Codex's
compaction) replaces the history with its `replacement_history`. A remote compaction's request
(compaction v2, on `/v1/responses`) writes no item, only its `token_usage_record` before the
`compacted` line, whose `replacement_history` ends with the `compaction` item it returned: rebuilt as
sent, the history then `{"type": "compaction_trigger"}`. Before v2 (codex-cli 0.104) Codex called
`/v1/responses/compact` and wrote no usage for it: no call here. Rollouts written before
`session_meta` existed hold a bare `{id, timestamp, instructions}` header, then bare items: read
the same way.

What it does not hold: the base-instructions message codex-cli 0.171 sends as the first `input`
item (a developer message composed from `session_meta.base_instructions` less the sections of
disabled tools: the stored text is not what was sent), the tool definitions,
`tool_choice`/`parallel_tool_calls`/`include`/`store` and the other request parameters. Each item carries
an `internal_chat_message_metadata_passthrough` object that is not sent: it is dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

from recorder.transcripts.common import Transcript, int_or_none, make_turn, openai_call, parse_time
from recorder.transcripts.lines import JsonLines
from recorder.turn import Turn

HARNESS = "codex"
ENDPOINT = "/v1/responses"
OUTPUT_TYPES = ("reasoning", "function_call", "custom_tool_call", "local_shell_call", "web_search_call")


# the item Codex ends a remote compaction request's input with (compaction v2, on /v1/responses)
COMPACTION_TRIGGER = {"type": "compaction_trigger"}
ITEM_TYPES = ("message", "reasoning", "function_call", "function_call_output", "custom_tool_call",
              "custom_tool_call_output", "local_shell_call", "web_search_call")


def looks_like(objs: list[dict]) -> bool:
    return any(o.get("type") == "session_meta" and isinstance(o.get("payload"), dict) for o in objs) \
        or _legacy(objs)


def _legacy(objs: list[dict]) -> bool:
    """A rollout written before `session_meta` (codex-cli of mid 2025): a bare header line
    `{id, timestamp, instructions?, git?}`, then `{"record_type": "state"}` markers and bare items."""
    if not objs or "type" in objs[0] or "payload" in objs[0]:
        return False
    head = objs[0]
    if not (isinstance(head.get("id"), str) and isinstance(head.get("timestamp"), str)):
        return False
    rest = objs[1:]
    return not rest or any(o.get("record_type") == "state" or o.get("type") in ITEM_TYPES for o in rest)


def _wrapped(lines: Iterable[tuple[int, dict]]) -> Iterator[tuple[int, dict]]:
    """A legacy rollout's lines in the current shape: the header as `session_meta`, each bare item
    as a `response_item` (state markers dropped)."""
    lines = iter(lines)
    for lineno, head in lines:
        yield lineno, {"type": "session_meta", "timestamp": head.get("timestamp"), "payload": head}
        break
    for lineno, obj in lines:
        if obj.get("type") in ITEM_TYPES or (isinstance(obj.get("type"), str) and "record_type" not in obj):
            yield lineno, {"type": "response_item", "timestamp": obj.get("timestamp"), "payload": obj}


def _is_output(item: dict) -> bool:
    """An item a model call returned (as opposed to one the harness added)."""
    return item.get("type") in OUTPUT_TYPES or (item.get("type") == "message" and item.get("role") == "assistant")


# Keys the rollout adds to an item that Codex does not send back.
ROLLOUT_ONLY_KEYS = ("internal_chat_message_metadata_passthrough",)


def _as_sent(item: dict) -> dict:
    return {k: v for k, v in item.items() if k not in ROLLOUT_ONLY_KEYS}


def _effort(turn_context: dict) -> str | None:
    """The reasoning effort a turn_context names (`effort`, or its collaboration mode's setting)."""
    settings = (turn_context.get("collaboration_mode") or {}).get("settings")
    effort = turn_context.get("effort") or (settings.get("reasoning_effort") if isinstance(settings, dict) else None)
    return effort if isinstance(effort, str) else None


def _is_summary_call(turn: Turn, compacted: dict) -> bool:
    """Whether `turn` is the call whose reply a local compaction's `message` quotes (Codex writes the
    summary's reply and usage, then the `compacted` line holding it)."""
    message, reply = compacted.get("message"), turn.response_text.strip()
    return isinstance(message, str) and bool(reply) and reply in message


def read(path: Path) -> list[Transcript]:
    """The rollout's session, its turns held (as every reader gives them)."""
    t, turns = stream(path, JsonLines(path))
    t.turns = list(turns)
    t.end_stream()
    t.stamp_notes()  # notes written after a turn was rebuilt travel on every turn
    t.compacted.update(n for n, turn in enumerate(t.turns, start=1) if turn.render["transcript"].get("compacted"))
    return [t] if t.turns else []


def stream(path: Path, source: Iterable[tuple[int, dict]]) -> tuple[Transcript, Iterator[Turn]]:
    """The rollout's session and an iterator of its rebuilt turns, read line by line from `source`
    (bounded memory: the running history is held once, as Codex holds it, and each turn's `input` is
    a list of the same item objects). The session's notes are complete once the iterator is spent."""
    source = iter(source)
    head = list(itertools.islice(source, 2))
    legacy = _legacy([o for _, o in head])
    lines: Iterator[tuple[int, dict]] = itertools.chain(head, source)
    if legacy:
        lines = _wrapped(lines)
        head = list(itertools.islice(lines, 1))
        lines = itertools.chain(head, lines)
    meta = next((o["payload"] for _, o in head if o.get("type") == "session_meta"
                 and isinstance(o.get("payload"), dict)), {})
    version = "rollout before session_meta" if legacy else \
        f"rollout of {meta.get('originator') or 'codex'} {meta.get('cli_version') or '(version not written)'}"
    t = Transcript(HARNESS, str(meta.get("id") or path.stem), str(path), version=version)
    if legacy:
        t.note("a rollout before session_meta: no token usage and no model recorded; user instructions "
               "(the header's `instructions`) are not rebuilt")
    t.harness_version = meta.get("cli_version") if isinstance(meta.get("cli_version"), str) else None
    # session_meta's base_instructions are the model's defaults, not what was sent: Codex drops the
    # sections of disabled tools (the fixture's run sent 17k of its 21k characters). Not guessed.
    t.note("system prompt not in the transcript: the base-instructions message Codex sends first is "
           "composed from session_meta's base_instructions, which it trims to the enabled tools")
    t.note("tool definitions not recorded")
    t.note("request parameters (tool_choice, parallel_tool_calls, reasoning, include, store, prompt_cache_key, "
           "client_metadata) not recorded")
    return t, _without_summary_calls(t, _turns(t, lines))


class _Compacted:
    """A `compacted` line, as `_turns` reads it: the summary `message` a local compaction quotes."""

    def __init__(self, payload: dict):
        self.payload = payload


def _without_summary_calls(t: Transcript, read: Iterator[Turn | _Compacted]) -> Iterator[Turn]:
    """The loop's calls: Codex writes a local compaction's summarisation call (its reply and usage) before
    the `compacted` line that quotes that reply, so a call is known to be the loop's only once the next
    line is read; one turn is held back until then. The summarisation call's last input item is Codex's
    own prompt, not in the file: it is left out with a note."""
    held: Turn | None = None
    summaries = 0
    for item in read:
        if isinstance(item, _Compacted):
            if held is not None and _is_summary_call(held, item.payload):
                held, t.rebuilt, summaries = None, t.rebuilt - 1, summaries + 1
            continue
        if held is not None:
            yield held
        held = item
    if held is not None:
        yield held
    if summaries:
        t.note(f"{summaries} compaction request(s) left out: Codex's summarisation prompt is not in the file")


def _turns(t: Transcript, lines: Iterable[tuple[int, dict]]) -> Iterator[Turn | _Compacted]:
    model = effort = None
    n = 0  # calls emitted (the turn id's number)
    compacted = False  # the next call is the first after a compaction
    items: list[dict] = []
    out: list[dict] = []  # the current call's output items
    sent: float | None = None  # when the current call's input was complete
    input_ts: float | None = None  # time of the last input item written
    usage: dict | None = None
    trigger_usage: dict | None = None  # a call that wrote no item: a remote compaction's, if `compacted` follows

    def emit() -> Turn | None:
        nonlocal out, usage, n, compacted
        if not out:
            usage = None
            return None
        body: dict = {"model": model, "input": items[: len(items) - len(out)]}
        if effort:  # the turn's reasoning effort: a cache-relevant parameter (analyzer/param_breakers.py)
            body["reasoning"] = {"effort": effort}
        calls = [openai_call(i.get("call_id"), i.get("name"), i.get("arguments", i.get("input", "")))
                 for i in out if i.get("type") in ("function_call", "custom_tool_call")]
        text = "".join(c.get("text", "") for i in out if i.get("type") == "message"
                       for c in i.get("content") or [] if isinstance(c, dict) and c.get("type") == "output_text")
        reasoning = "".join(s.get("text", "") for i in out if i.get("type") == "reasoning"
                            for s in i.get("summary") or [] if isinstance(s, dict))
        prompt = cached = completion = None
        if usage:
            prompt, completion = int_or_none(usage.get("input_tokens")), int_or_none(usage.get("output_tokens"))
            cached = int_or_none(usage.get("cached_input_tokens"))
        n += 1
        turn = make_turn(t, n, sent, ENDPOINT, body, text=text, reasoning=reasoning,
                         tool_calls=calls, finish_reason="tool_calls" if calls else "stop",
                         prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached, usage=usage)
        out, usage = [], None
        kept = t.kept(turn, compacted=compacted)
        compacted = compacted and kept is None
        return kept

    for _lineno, obj in lines:
        kind, payload = obj.get("type"), obj.get("payload")
        ts = parse_time(obj.get("timestamp"))
        if not isinstance(payload, dict):
            continue
        if kind == "turn_context":
            model = payload.get("model") or model
            effort = _effort(payload)
        elif kind == "compacted":
            if (turn := emit()) is not None:
                yield turn
            replacement = payload.get("replacement_history")
            if trigger_usage is not None and isinstance(replacement, list) and replacement and \
                    isinstance(replacement[-1], dict) and replacement[-1].get("type") == "compaction":
                # Remote compaction (Codex's compaction v2): the history plus Codex's trigger item went
                # to /v1/responses, the one `compaction` item the replacement ends with came back
                items.extend([dict(COMPACTION_TRIGGER), replacement[-1]])  # the input, then the call's output
                out, usage = [replacement[-1]], trigger_usage
                sent = input_ts
                if (turn := emit()) is not None:
                    t.note("the `compaction_trigger` item ending remote compaction requests is not in the file: "
                           "added back as Codex sends it; their reply is the `compaction` item the `compacted` "
                           "line ends with")
                    yield turn
            trigger_usage = None
            yield _Compacted(payload)
            t.note("compacted: Codex replaced the history with a summary; items after it rebuilt from there")
            compacted = True
            items = [_as_sent(i) for i in replacement if isinstance(i, dict)] if isinstance(replacement, list) else []
        elif kind == "token_usage_record":  # written as a call completes, right after its output
            usage = payload.get("usage") if isinstance(payload.get("usage"), dict) else None
            if not out:  # no output item written: a remote compaction's call, known at its `compacted` line
                trigger_usage, usage = usage, None
            elif (turn := emit()) is not None:
                yield turn
        elif kind == "event_msg" and payload.get("type") == "token_count" and out:
            info = payload.get("info")
            if isinstance(info, dict) and isinstance(info.get("last_token_usage"), dict):
                usage = info["last_token_usage"]
            if (turn := emit()) is not None:
                yield turn
        elif kind == "response_item":
            if _is_output(payload):
                if not out:
                    sent = input_ts
                out.append(payload)
            else:
                if (turn := emit()) is not None:
                    yield turn
                input_ts = ts if ts is not None else input_ts
            items.append(_as_sent(payload))
    if (turn := emit()) is not None:
        yield turn

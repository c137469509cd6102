"""Parameter breakers: a provider-documented request parameter that changed within a session is named
`param_change/<parameter>` with both values and a fix, though the rendered prompt only grew."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from analyzer.analysis import analyze
from recorder.jsonl import import_jsonl

TRAFFIC = Path("/work/shared/traffic/claude_tiny.jsonl")
ANTHROPIC = "https://api.anthropic.com"


def _claude_main_chain() -> list[dict]:
    """Claude Code's real main-chain requests (those under its conversation id), re-pointed at Anthropic."""
    records = [json.loads(line) for line in TRAFFIC.read_text().splitlines()]
    chain = [r for r in records if isinstance(r.get("session"), str) and '"session_id"' in r["session"]
             and len((r.get("request") or {}).get("messages", [])) >= 3][:3]
    assert len(chain) == 3
    for r in chain:
        r["upstream"] = ANTHROPIC
    return chain


def _write(tmp_path: Path, records: list[dict]) -> Path:
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def _growing(edit=None, n: int = 3, upstream: str | None = ANTHROPIC, endpoint: str = "/v1/messages") -> list[dict]:
    system = "You are a careful coding agent. " * 40
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": "fix the failing test"}]
        for k in range(i):
            messages += [{"role": "assistant", "content": f"looked at file {k}"}, {"role": "user", "content": f"go on {k}"}]
        body = {"model": "claude-sonnet-4-5", "max_tokens": 512, "system": system, "messages": messages,
                "tool_choice": {"type": "auto"}}
        record = {"id": f"r{i}", "ts": 1_700_000_000 + 10 * i, "session": "s", "endpoint": endpoint, "request": body}
        if upstream:
            record["upstream"] = upstream
        if edit:
            edit(i, record)
        out.append(record)
    return out


def _breaks(report):
    return [(t.number, t.brk) for s in report.sessions for t in s.turns if t.brk is not None]


def test_tool_choice_change_is_named_with_both_values_and_keeps_the_head(tmp_path):
    def force_tool(i, record):
        if i == 2:
            record["request"]["tool_choice"] = {"type": "tool", "name": "Read"}

    report = analyze(_write(tmp_path, _growing(force_tool)))
    [(number, brk)] = _breaks(report)
    assert number == 3 and (brk.cause, brk.subtype) == ("param_change", "tool_choice")
    assert brk.before == 'tool_choice: {"type": "auto"}'
    assert brk.after == 'tool_choice: {"name": "Read", "type": "tool"}'
    assert "keep it fixed" in brk.suggestion and brk.where() == "the request parameters"
    turn = report.sessions[0].turns[2]
    # Anthropic keeps the tools and the system prompt: the system prompt's tokens stay cached.
    assert 0 < turn.common_prefix_tokens < report.sessions[0].turns[1].prompt_tokens
    assert turn.lost_tokens > 0


def test_same_parameters_are_no_break(tmp_path):
    report = analyze(_write(tmp_path, _growing()))
    assert _breaks(report) == []


def test_real_claude_code_beta_header_set_change_is_named(tmp_path):
    chain = _claude_main_chain()
    assert _breaks(analyze(_write(tmp_path, chain))) == [] or all(
        b.cause != "param_change" for _, b in _breaks(analyze(_write(tmp_path, chain))))
    # The header set Claude Code 2.1.197 sends on its first request of a run, on the chain's last turn.
    probe = json.loads(TRAFFIC.read_text().splitlines()[1])["request_headers"]["anthropic-beta"]
    chain[2]["request_headers"] = {**chain[2]["request_headers"], "anthropic-beta": probe}
    breaks = [b for _, b in _breaks(analyze(_write(tmp_path, chain))) if b.cause == "param_change"]
    assert [b.subtype for b in breaks] == ["anthropic-beta"]
    assert "context-management-2025-06-27" in breaks[0].before and "context-management" not in breaks[0].after
    assert breaks[0].token_offset == 0  # the whole prefix is lost


def test_thinking_budget_and_images_and_effort_are_breakers(tmp_path):
    def thinking(i, record):
        record["request"]["thinking"] = {"type": "enabled", "budget_tokens": 2048 if i < 2 else 8192}

    assert [b.subtype for _, b in _breaks(analyze(_write(tmp_path, _growing(thinking))))] == ["thinking.budget_tokens"]

    def image(i, record):
        if i == 2:
            record["request"]["messages"][-1]["content"] = [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                {"type": "text", "text": record["request"]["messages"][-1]["content"]}]

    assert [b.subtype for _, b in _breaks(analyze(_write(tmp_path, _growing(image))))] == ["images"]

    def effort(i, record):
        record["request"]["output_config"] = {"effort": "high" if i != 1 else "low"}

    assert [(n, b.subtype) for n, b in _breaks(analyze(_write(tmp_path, _growing(effort))))] == [
        (2, "output_config.effort"), (3, "output_config.effort")]


def test_web_search_toggle_is_named_not_a_tool_edit(tmp_path):
    def web(i, record):
        record["request"]["tools"] = [{"type": "web_search_20250305", "name": "web_search"}] if i == 2 else []

    [(number, brk)] = _breaks(analyze(_write(tmp_path, _growing(web))))
    assert (number, brk.cause, brk.subtype) == (3, "param_change", "web_search")
    assert (brk.before, brk.after) == ("web_search: false", "web_search: true")
    assert "only the tools stay cached" in brk.suggestion


def test_embedded_engine_keeps_its_cache_across_tool_choice(tmp_path):
    def force_tool(i, record):
        if i == 2:
            record["request"]["tool_choice"] = {"type": "any"}

    report = analyze(_write(tmp_path, _growing(force_tool, upstream="embedded:tiny-llama")))
    assert _breaks(report) == []


def test_openai_prompt_cache_key_change_is_named(tmp_path):
    def body(i):
        return {"model": "gpt-5", "input": [{"role": "user", "content": "hello " + "x " * 200}]
                + [{"role": "user", "content": f"more {k}"} for k in range(i)],
                "prompt_cache_key": "agent-1" if i < 2 else "agent-2"}

    records = [{"id": f"r{i}", "ts": 100 + i, "session": "s", "endpoint": "/v1/responses",
                "upstream": "https://api.openai.com/v1", "request": body(i)} for i in range(3)]
    [(number, brk)] = _breaks(analyze(_write(tmp_path, records)))
    assert (number, brk.subtype, brk.before, brk.after) == (
        3, "prompt_cache_key", 'prompt_cache_key: "agent-1"', 'prompt_cache_key: "agent-2"')


def test_local_chat_template_kwargs_are_named_by_key(tmp_path):
    def chat(i):
        return {"model": "qwen", "messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "hi"}]
                + [{"role": "user", "content": f"more {k}"} for k in range(i)],
                "chat_template_kwargs": {"enable_thinking": i < 2}}

    records = [{"id": f"r{i}", "ts": 100 + i, "session": "s", "endpoint": "/v1/chat/completions",
                "upstream": "embedded:qwen", "request": chat(i)} for i in range(3)]
    path = _write(tmp_path, records)
    # A template that renders the switch at the head (as /think and /no_think system notes do).
    template = tmp_path / "t.jinja"
    template.write_text("{% if enable_thinking %}/think{% else %}/no_think{% endif %}\n"
                        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")
    breaks = _breaks(analyze(path, template=template))
    assert [(n, b.cause, b.subtype) for n, b in breaks] == [(3, "param_change", "chat_template_kwargs.enable_thinking")]
    assert (breaks[0][1].before, breaks[0][1].after) == ("chat_template_kwargs.enable_thinking: true",
                                                         "chat_template_kwargs.enable_thinking: false")
    # A template that does not render it keeps the prompt: a local server keeps its cache.
    assert _breaks(analyze(path)) == []


def test_headers_come_through_the_recorder_database(tmp_path):
    chain = _claude_main_chain()
    probe = json.loads(TRAFFIC.read_text().splitlines()[1])["request_headers"]["anthropic-beta"]
    chain[2]["request_headers"] = {**chain[2]["request_headers"], "anthropic-beta": probe}
    db = tmp_path / "rec.db"
    import_jsonl(_write(tmp_path, copy.deepcopy(chain)), db)
    assert [b.subtype for _, b in _breaks(analyze(db)) if b.cause == "param_change"] == ["anthropic-beta"]


def test_codex_transcript_reasoning_effort_change_is_named(tmp_path):
    from recorder.transcripts import transcript_turns

    rollout = next(Path("fixtures/transcripts/codex").glob("rollout-*.jsonl"))
    lines = [json.loads(line) for line in rollout.read_text().splitlines()]
    context = next(i for i, o in enumerate(lines) if o["type"] == "turn_context")
    lines[context]["payload"]["effort"] = "medium"
    # The user raised the effort before the second call (as `/model` does in Codex).
    output = next(i for i, o in enumerate(lines) if o.get("payload", {}).get("type") == "function_call_output")
    raised = copy.deepcopy(lines[context])
    raised["payload"]["effort"] = "high"
    lines.insert(output + 1, raised)
    path = tmp_path / rollout.name
    path.write_text("\n".join(json.dumps(o) for o in lines) + "\n")
    turns, _ = transcript_turns(path)
    assert [t.request_body.get("reasoning") for t in turns] == [{"effort": "medium"}, {"effort": "high"}]
    [(number, brk)] = _breaks(analyze(turns))
    assert (number, brk.cause, brk.subtype) == (2, "param_change", "reasoning.effort")
    assert (brk.before, brk.after) == ('reasoning.effort: "medium"', 'reasoning.effort: "high"')

"""Analyzer library: causes (one fixture each), both levels, cost, sessions, loading."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from analyzer import CAUSES, analyze, assert_prefix_stable, check, format_text, render_request, to_json
from analyzer.causes import is_volatile
from analyzer.load import IncrementalParser
from analyzer.render import TemplateRenderer
from prefixtrace.common.errors import InvalidRequest

ROOT = Path(__file__).resolve().parents[1]
SESSIONS = ROOT / "fixtures" / "sessions"
TEMPLATES = ROOT / "fixtures" / "templates"
sys.path.insert(0, str(SESSIONS))
from build_cause_fixtures import CASES, TEMPLATES as CASE_TEMPLATES  # noqa: E402


def _last_break(name):
    t = CASE_TEMPLATES.get(name)
    report = analyze(SESSIONS / f"cause_{name}.jsonl", template=TEMPLATES / t if t else None)
    return report.sessions[0].turns[-1].brk


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_cause_fixture_is_named_correctly(name):
    brk = _last_break(name)
    if name == "append_only":
        assert brk is None
        return
    expected = "system_rewrite" if name.startswith("system_rewrite") else name
    assert brk.cause == expected
    assert brk.before != brk.after and brk.char_offset >= 0 and brk.token_offset >= 0
    if name == "system_rewrite_volatile":
        assert brk.subtype == "volatile:counter"  # the kind of value is named (issue 26)


def test_every_cause_name_has_a_fixture():
    covered = {"system_rewrite" if n.startswith("system_rewrite") else n for n in CASES}
    assert covered == set(CAUSES)


def test_volatile_means_only_numbers_and_times_changed():
    assert is_volatile("(stale: 2 turns)", "(stale: 3 turns)")
    assert is_volatile("updated 2026-10-05 12:01", "updated 2026-10-06 09:15")
    assert is_volatile("context 41%", "context 57%")
    assert not is_volatile("mode: safe", "mode: yolo")


def test_json_schema_fields():
    d = analyze(SESSIONS / "todo_stale.jsonl").to_dict()
    turn = d["sessions"][0]["turns"][1]
    for key in ("index", "prompt_tokens", "common_prefix_tokens", "reprefill_tokens", "reported_cached_tokens", "break"):
        assert key in turn
    assert set(turn["break"]) >= {"cause", "subtype", "message_index", "role", "char_offset", "token_offset",
                                  "before", "after"}
    assert d["sessions"][0]["id"] == "todo-stale"
    assert d["totals"]["by_cause"]["system_rewrite"]["breaks"] == 3
    assert turn["reprefill_tokens"] == turn["prompt_tokens"] - turn["common_prefix_tokens"]
    json.loads(to_json(analyze(SESSIONS / "todo_stale.jsonl")))


def test_cost_block_size_rate_and_reported_disagreement(tmp_path):
    lines = [
        {"session": "s", "ts": 1, "request": {"messages": [{"role": "user", "content": "a " * 500}]},
         "usage": {"prompt_tokens": 500, "prompt_tokens_details": {"cached_tokens": 0}}},
        {"session": "s", "ts": 2, "request": {"messages": [{"role": "user", "content": "a " * 500},
                                                            {"role": "assistant", "content": "ok"}]},
         "usage": {"prompt_tokens": 510, "prompt_tokens_details": {"cached_tokens": 0}}},  # a miss the prediction disagrees with
        {"session": "s", "ts": 3, "request": {"messages": [{"role": "user", "content": "b"}]},
         "usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": None}}},
    ]
    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = analyze(src, block_size=64, prefill_rate=100.0)
    t0, t1, t2 = r.sessions[0].turns
    assert t1.predicted_cached_tokens % 64 == 0 and t1.predicted_cached_tokens <= t1.common_prefix_tokens
    assert t1.cached_disagrees is True
    assert t2.reported_cached_tokens is None and t2.cached_disagrees is None  # unknown, never a miss
    assert t1.reprefill_seconds == pytest.approx(t1.block_reprefill_tokens / 100.0, abs=0.01)
    assert "seconds" in r.to_dict()["totals"]["by_cause"]["history_edit"] or r.to_dict()["totals"]["by_cause"]


def test_malformed_lines_are_reported_and_skipped(tmp_path):
    src = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    src.write_text(f"{good}\n{{broken\n[1, 2]\n{good}\n")
    r = analyze(src)
    assert [s["line"] for s in r.skipped] == [2, 3]
    assert sum(len(s.turns) for s in r.sessions) == 2
    assert "skipped line 2" in format_text(r)


def test_interleaved_sessions_are_inferred_apart():
    def conv(tag, n):
        msgs, out = [{"role": "system", "content": "shared system prompt"}], []
        for i in range(n):
            msgs = msgs + [{"role": "user", "content": f"{tag} task {i}"}]
            out.append({"messages": msgs})
            msgs = msgs + [{"role": "assistant", "content": f"{tag} done {i}"}]
        return out
    a, b = conv("orchestrator", 4), conv("subagent", 4)
    r = analyze([x for pair in zip(a, b) for x in pair])
    assert len(r.sessions) == 2 and all(len(s.turns) == 4 for s in r.sessions)
    assert not r.breaks


def test_rewritten_system_prompt_stays_one_inferred_session():
    bodies = [{"messages": [{"role": "system", "content": f"sys (stale: {i})"}, {"role": "user", "content": "task"}]
               + [{"role": "assistant", "content": f"step {j}"} for j in range(i)]} for i in range(3)]
    r = analyze(bodies)
    assert len(r.sessions) == 1 and [t.brk.cause for t in r.sessions[0].turns[1:]] == ["system_rewrite"] * 2


def test_template_renderer_matches_a_plain_render():
    body = json.loads((SESSIONS / "cause_thinking_strip.jsonl").read_text().splitlines()[0])["request"]
    renderer = TemplateRenderer.from_file(TEMPLATES / "qwen3_style.jinja")
    text = renderer.render(body).text
    from jinja2 import Environment
    env = Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    plain = env.from_string((TEMPLATES / "qwen3_style.jinja").read_text())
    assert text == plain.render(messages=body["messages"], tools=body["tools"], add_generation_prompt=False)
    assert "<think>" in text and not text.endswith("<|im_start|>assistant\n")


def test_strict_template_raises_on_late_system_message_and_turn_is_unrenderable():
    r = analyze(SESSIONS / "cause_system_fold.jsonl", template=TEMPLATES / "qwen35_style.jinja")
    assert "System message must be at the beginning" in r.sessions[0].turns[-1].note


def test_preserve_thinking_keeps_reasoning():
    body = json.loads((SESSIONS / "cause_thinking_strip.jsonl").read_text().splitlines()[1])["request"]
    renderer = TemplateRenderer.from_file(TEMPLATES / "qwen35_style.jinja")
    assert "I should read a.py" not in renderer.render(body).text
    kept = renderer.render({**body, "chat_template_kwargs": {"preserve_thinking": True}}).text
    assert "I should read a.py" in kept


def test_model_dir_template_and_tokenizer():
    r = analyze(SESSIONS / "append_only.jsonl", model=ROOT / "fixtures" / "tiny-llama")
    assert r.renderer.startswith("model:") and r.tokenizer.startswith("hf:")
    assert not r.breaks


@pytest.mark.skipif(not Path("/work/shared/templates/qwen3.jinja").is_file(), reason="real Qwen3 template absent")
def test_real_qwen3_template_strips_thinking_at_a_notice():
    brk = analyze(SESSIONS / "cause_thinking_strip.jsonl", template="/work/shared/templates/qwen3.jinja").breaks[0][1].brk
    assert brk.cause == "thinking_strip"


def test_incremental_parser_equals_json_loads():
    lines = (SESSIONS / "todo_stale.jsonl").read_text().splitlines() + (SESSIONS / "append_only.jsonl").read_text().splitlines()
    p = IncrementalParser()
    for line in lines:
        assert p.loads(line) == json.loads(line)


def test_check_and_fixture_function():
    assert check(SESSIONS / "append_only.jsonl").ok
    result = check(SESSIONS / "todo_stale.jsonl", allow="compaction")
    assert not result.ok and "system_rewrite" in result.summary()
    assert check(SESSIONS / "todo_stale.jsonl", allow="system_rewrite").ok
    with pytest.raises(InvalidRequest):
        check(SESSIONS / "todo_stale.jsonl", allow="nonsense")
    bodies = [json.loads(x)["request"] for x in (SESSIONS / "cause_compaction.jsonl").read_text().splitlines()]
    assert_prefix_stable(bodies, allow="compaction")
    with pytest.raises(AssertionError, match="compaction"):
        assert_prefix_stable(bodies)


def test_generic_render_has_no_generation_prompt():
    text = render_request({"messages": [{"role": "user", "content": "hi"}]}).text
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_recorder_database_is_a_source(tmp_path):
    from recorder.jsonl import import_jsonl

    db = tmp_path / "t.db"
    import_jsonl(SESSIONS / "todo_stale.jsonl", db)
    report = analyze(db)
    assert report.sessions[0].id == "todo-stale"
    assert [t.brk.cause for t in report.sessions[0].turns[1:]] == ["system_rewrite"] * 3


def test_synthetic_interleaved_sessions_are_recovered_without_ids():
    sys.path.insert(0, str(ROOT))
    from testsupport.synthetic_log import generate_records

    events = [(0, 5, "todo_tick"), (0, 9, "todo_tick"), (1, 6, "notice"), (2, 8, "tools_reorder")]
    records = list(generate_records(n_requests=90, n_sessions=5, start_tokens=2500, cap_tokens=40000, events=events))
    report = analyze([r["request"] for r in records])
    truth = {}
    for r in records:
        truth.setdefault(r["session"], []).append(r["id"])
    assert len(report.sessions) == len(truth)
    ids = {r["id"]: i for i, r in enumerate(records)}
    got = sorted(sorted(int(t.request_id.split("-")[1]) for t in s.turns) for s in report.sessions)
    assert got == sorted(sorted(ids[i] for i in v) for v in truth.values())

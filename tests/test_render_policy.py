"""Render policies (issue 9): a scripted harness session stays append-only under
inline + loop and shows the expected breaks under fold + template, checked with
the project's analyzer; the engine renders exactly what the analyzer checked;
each turn's record carries the applied policies."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx
import pytest

from analyzer import TemplateRenderer, analyze, assert_prefix_stable
from testsupport.harness_session import harness_session, model_dir_with_template
from engine.engine import Engine
from engine.render_policy import (
    SYSTEM_NOTE_HEADER, BoundPolicy, NoticeRule, PolicyAnalyzerRenderer, RenderPolicy, TemplateTraits,
)
from prefixtrace.common.errors import EngineError, InvalidRequest
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from tests.conftest import TINY_MODEL, running_server

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "templates"
ALL = ("qwen3_style", "qwen35_style", "qwen35_merge_system")


def renderer(template: str, mid: str, retention: str, **kw) -> PolicyAnalyzerRenderer:
    return PolicyAnalyzerRenderer(TemplateRenderer.from_file(TEMPLATES / f"{template}.jinja"),
                                  RenderPolicy(mid, retention, **kw))


def breaks(bodies, r) -> list[tuple[int, str]]:
    (session,) = analyze(bodies, renderer=r, workers=1).sessions
    assert not [t.note for t in session.turns if t.note not in ("", "first")]  # every request rendered
    return [(t.index, t.brk.cause) for t in session.turns if t.brk]


@pytest.mark.parametrize("template", ALL)
def test_harness_session_is_append_only_under_inline_and_loop(template):
    assert_prefix_stable(harness_session(), renderer=renderer(template, "inline", "loop"), workers=1)


@pytest.mark.parametrize("template", ALL)
def test_fold_and_template_break_at_every_notice_and_the_system_update(template):
    # todo notice, system update, subagent result, background-job notice
    assert breaks(harness_session(), renderer(template, "fold", "template")) == [
        (2, "thinking_strip"), (3, "system_fold"), (5, "thinking_strip"), (7, "thinking_strip")]


def test_each_policy_removes_its_own_cause():
    bodies = harness_session()
    assert breaks(bodies, renderer("qwen35_style", "fold", "loop")) == [(3, "system_fold")]
    assert [c for _, c in breaks(bodies, renderer("qwen35_style", "inline", "template"))] == ["thinking_strip"] * 3
    assert breaks(bodies, renderer("qwen35_style", "inline", "all")) == []


def test_a_real_user_message_ends_the_loop_once():
    assert breaks(harness_session(follow_up=True), renderer("qwen35_style", "inline", "loop")) == [(8, "thinking_strip")]


def test_the_guard_cuts_once_then_stays_append_only():
    bodies = harness_session()
    # Word counts stand in for tokens here; the loop's reasoning: 121, 80, 100, 140, 61, 90, 80 words.
    # 441 > 400 at the 4th (first sent in request 4): one cut; 61 + 90 + 80 stay under the guard after it.
    assert breaks(bodies, renderer("qwen35_style", "inline", "loop", guard_tokens=400)) == [(4, "thinking_strip")]
    # 301 > 300 at the 3rd, then 140 + 61 + 90 + 80 = 371 > 300 at the 7th: one cut per guard's worth.
    assert breaks(bodies, renderer("qwen35_style", "inline", "loop", guard_tokens=300)) == [
        (3, "thinking_strip"), (7, "thinking_strip")]
    assert breaks(bodies, renderer("qwen35_style", "inline", "loop", guard_tokens=10_000)) == []


def test_notice_rule_is_configurable():
    rule = NoticeRule(r"\s*NOTE:")
    assert rule.is_notice({"role": "user", "content": "NOTE: job 3 finished"})
    assert not rule.is_notice({"role": "user", "content": "<todo-update>x</todo-update>"})
    assert rule.is_notice({"role": "user", "name": "harness", "content": "anything"})
    assert rule.is_notice({"role": "user", "content": "<tool_response>\nok\n</tool_response>"})
    assert not rule.is_notice({"role": "assistant", "content": "NOTE: no"})
    default = NoticeRule()
    for text in ("<system-reminder>x", "[todo update] a", "<background-job id=1>", "[subagent result] r"):
        assert default.is_notice({"role": "user", "content": text}), text
    assert not default.is_notice({"role": "user", "content": "please fix [todo] items"})
    with pytest.raises(EngineError):
        NoticeRule("(")


def test_strict_names_the_message_index_and_developer_is_system():
    bound = BoundPolicy(RenderPolicy("strict"), TemplateTraits(True, True), len)
    messages = [{"role": "developer", "content": "head"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"}, {"role": "developer", "content": "later"}]
    with pytest.raises(InvalidRequest, match=r"messages\[3\] is a developer message"):
        bound.apply(messages)
    applied = bound.apply(messages[:3])
    assert applied.messages[0]["role"] == "system" and applied.record["mid_system_messages"] == 0


def test_inline_rewrites_into_a_marked_note_only_when_the_template_cannot_render_in_place():
    messages = [{"role": "system", "content": "head"}, {"role": "user", "content": "u"},
                {"role": "system", "content": "update"}]
    native = BoundPolicy(RenderPolicy(), TemplateTraits(inline_system=True), len).apply(messages)
    assert native.messages == messages and native.record["mid_system_as"] == "in_place"
    note = BoundPolicy(RenderPolicy(), TemplateTraits(inline_system=False), len).apply(messages)
    assert note.messages[2] == {"role": "user", "content": f"{SYSTEM_NOTE_HEADER}\nupdate"}
    folded = BoundPolicy(RenderPolicy("fold"), TemplateTraits(), len).apply(messages)
    assert folded.messages == [{"role": "system", "content": "head\n\nupdate"}, {"role": "user", "content": "u"}]


def test_traits_probe_the_fixture_templates():
    probe = lambda name: renderer(name, "inline", "loop").bound.traits  # noqa: E731
    assert probe("qwen3_style") == TemplateTraits(inline_system=True, preserve_thinking=True)
    assert probe("qwen35_style") == TemplateTraits(inline_system=False, preserve_thinking=True)
    assert probe("qwen35_merge_system") == TemplateTraits(inline_system=False, preserve_thinking=True)


@pytest.fixture
def policy_model(tmp_path):
    return model_dir_with_template(TINY_MODEL, TEMPLATES / "qwen35_style.jinja", tmp_path / "model")


def start(model_dir, **kw) -> Engine:
    engine = Engine(model_dir, name="tiny-llama", dtype="float32", **kw).start()
    engine.wait_ready(60)
    return engine


def test_engine_renders_what_the_analyzer_checked_and_each_prompt_extends_the_last(policy_model):
    engine = start(policy_model, mid_system_policy="inline", thinking_retention="loop")
    try:
        check = renderer("qwen35_style", "inline", "loop")
        prev = None
        for body in harness_session(scale=0.3):
            r = engine.render(body["messages"], tools=body["tools"])
            assert r.text == check.render(body).text + "<|im_start|>assistant\n"
            if prev is not None:
                assert r.token_ids[: len(prev)] == prev
            prev = r.token_ids
        assert r.policy["mid_system_as"] == "user_note" and r.policy["thinking_retention"] == "loop"
        assert r.policy["reasoning_kept"] == 7 and r.policy["kept_over_template"] == 7
    finally:
        engine.shutdown()


def test_a_template_without_preserve_thinking_falls_back_and_says_so(tiny_engine):
    r = tiny_engine.render([{"role": "user", "content": "q"},
                            {"role": "assistant", "content": "a", "reasoning_content": "r"},
                            {"role": "user", "content": "<todo-update>x</todo-update>"}])
    assert r.policy["thinking_retention"] == "template" and "preserve_thinking" in r.policy["fallback"]


def test_engine_rejects_unknown_policies():
    with pytest.raises(EngineError):
        Engine(TINY_MODEL, mid_system_policy="merge")
    with pytest.raises(EngineError):
        Engine(TINY_MODEL, thinking_retention="some")


def test_policies_are_recorded_per_turn_and_strict_is_a_400(policy_model, recorder):
    engine = start(policy_model, mid_system_policy="strict")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello", "reasoning_content": "think"},
                {"role": "user", "content": "[todo update] 1 done"}]
    try:
        with running_server(create_app(EngineBackend(engine), recorder)) as url:
            ok = httpx.post(url + "/v1/chat/completions", timeout=60,
                            json={"model": "default", "messages": messages, "max_tokens": 2})
            bad = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "model": "default", "messages": messages + [{"role": "system", "content": "late"}], "max_tokens": 2})
    finally:
        engine.shutdown()
    assert ok.status_code == 200
    assert bad.status_code == 400 and "messages[4]" in bad.json()["error"]["message"]
    recorder.flush()
    con = sqlite3.connect(recorder.path)
    (render,) = [json.loads(r[0]) for r in con.execute("select render from turns where status = 200")]
    assert render["policy"]["mid_system"] == "strict" and render["policy"]["thinking_retention"] == "loop"
    assert render["policy"]["notices"] == 1 and render["policy"]["kept_over_template"] == 1


def test_serve_flags_reach_the_engine(policy_model):
    from click.testing import CliRunner

    from prefixtrace.cli import cli
    from prefixtrace.serve import ServeConfig, build_backend

    out = CliRunner().invoke(cli, ["serve", "--mid-system-policy", "fold", "--thinking-retention", "all",
                                   "--thinking-retention-guard-tokens", "500", "--print-config"])
    assert out.exit_code == 0, out.output
    for flag in ("mid_system_policy", "thinking_retention", "thinking_retention_guard_tokens", "notice_pattern"):
        assert flag.replace("_", "-") in out.output or flag in out.output
    backend = build_backend(ServeConfig(model=policy_model, mid_system_policy="fold", thinking_retention="all",
                                        thinking_retention_guard_tokens=500, notice_pattern=r"NOTE:"))
    try:
        policy = backend.engine.render_policy
        assert (policy.mid_system, policy.thinking_retention, policy.guard_tokens) == ("fold", "all", 500)
        assert policy.notices.pattern == "NOTE:"
    finally:
        backend.engine.wait_ready(60)
        backend.engine.shutdown()

import json
from pathlib import Path

import pytest

from analyzer import (
    analyze,
    check,
    compare,
    default_tokenizer,
    format_text,
    group_sessions,
    load_tokenizer,
    render_request,
    to_json,
)
from analyzer.tokens import REGEX_TOKENIZER
from prefixtrace.errors import InvalidRequest
from recorder import Recorder, Turn

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sessions"
SYSTEM = "You are a coding agent. Follow the user's instructions."


def stale_system(n: int) -> str:
    return f"{SYSTEM}\nTodo: write tests (stale: {n} turns without an update)"


def conversation(n_turns: int, system=lambda i: SYSTEM, tag: str = "") -> list[dict]:
    """Request bodies of an agent that resends its whole history each turn."""
    bodies, history = [], []
    for i in range(n_turns):
        history = history + [{"role": "user", "content": f"{tag}task {i}"}]
        bodies.append({"model": "m", "messages": [{"role": "system", "content": system(i)}, *history]})
        history = history + [{"role": "assistant", "content": f"{tag}done {i}"}]
    return bodies


def turns_of(bodies, session=None, t0=0.0, step=1.0, prefix="r"):
    return [
        Turn(f"{prefix}{i}", t0 + i * step, "/v1/chat/completions", "u", b, session_id=session)
        for i, b in enumerate(bodies)
    ]


# -- render -------------------------------------------------------------------


def test_render_spans_map_offsets_to_messages():
    body = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]}
    r = render_request(body)
    assert r.text == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert r.text[: r.prompt_end].endswith("hi<|im_end|>\n")
    for i, span in enumerate(r.spans):
        assert r.locate(span.start) == ("header", i, None)
        assert r.locate(span.body_start) == ("body", i, 0)
        assert r.locate(span.end - 1)[1] == i
    assert r.locate(r.prompt_end)[0] == "generation_prompt"


def test_render_flattens_parts_and_ignores_transport_fields():
    plain = {"messages": [{"role": "user", "content": "ab"}], "tools": [{"type": "function", "function": {"name": "f"}}]}
    decorated = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}}]}
        ],
        "tools": [{"type": "function", "function": {"name": "f"}, "cache_control": {"type": "ephemeral"}}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 10,
        "temperature": 0.2,
        "prompt_cache_key": "abc",
    }
    assert render_request(plain).text == render_request(decorated).text
    assert render_request(plain).tools_span[0] == 0


def test_render_tool_calls_as_json():
    call = [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"dir": "."}'}}]
    r = render_request({"messages": [{"role": "assistant", "content": None, "tool_calls": call}]})
    assert json.dumps(call) in r.text


def test_render_rejects_non_chat_bodies():
    with pytest.raises(InvalidRequest):
        render_request("not json at all")
    with pytest.raises(InvalidRequest):
        render_request({"model": "m"})


# -- divergence ---------------------------------------------------------------


def test_todo_stale_counter_divergence_in_system_message():
    bodies = conversation(2, system=lambda i: stale_system(i + 2))
    d = compare(bodies[0], bodies[1], REGEX_TOKENIZER)
    assert d.classification == "diverged"
    assert d.message_index == 0 and d.region == "body"
    assert d.offset_in_message == stale_system(2).index("2 turns")
    assert d.offset == len("<|im_start|>system\n") + d.offset_in_message == d.common_chars
    assert d.before.endswith("(stale: ")
    assert d.prev_after.startswith("2 turns") and d.next_after.startswith("3 turns")
    assert 0 < d.common_tokens < d.prev_tokens


def test_append_only_pair():
    a, b = conversation(2)
    d = compare(a, b, REGEX_TOKENIZER)
    assert d.append_only and d.offset is None and d.describe() == "append-only"
    assert d.common_chars >= render_request(a).prompt_end
    assert d.common_tokens > 0


def test_system_message_appended_at_end_is_append_only():
    a = conversation(1)[0]
    b = {"messages": [*a["messages"], {"role": "assistant", "content": "ok"}, {"role": "system", "content": "reminder"}]}
    assert compare(a, b, REGEX_TOKENIZER).append_only


def test_system_message_inserted_mid_conversation_diverges_there():
    a, b = conversation(3)[1:]
    msgs = list(b["messages"])
    msgs.insert(2, {"role": "system", "content": "Reminder: be brief."})
    d = compare(a, {"messages": msgs}, REGEX_TOKENIZER)
    assert not d.append_only
    assert d.message_index == 2 and d.region == "header"


def test_shorter_next_request_is_located_in_prev():
    a, b = conversation(3)[2], conversation(3)[0]
    d = compare(a, b, REGEX_TOKENIZER)
    assert not d.append_only and d.message_index is not None


def test_pluggable_tokenizer_is_named():
    def chars(text):
        return [ord(c) for c in text]

    a, b = conversation(2)
    d = compare(a, b, chars)
    assert d.tokenizer == "chars" and d.common_tokens == d.common_chars


def test_default_tokenizer_is_tiktoken_or_named_fallback():
    tok = default_tokenizer()
    assert tok.name.startswith("tiktoken:o200k_base") or tok.name.startswith("regex-words (tiktoken o200k_base unavailable")
    assert tok("hello world") == tok("hello world") and len(tok("hello world")) >= 2


def test_hf_tokenizer_from_fixture_model():
    tok = load_tokenizer(str(Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama"))
    assert tok.name.startswith("hf:") and len(tok("hello world")) > 0


# -- sessions -----------------------------------------------------------------


def interleave(*streams):
    out = []
    for group in zip(*streams):
        out.extend(group)
    return out


def test_interleaved_sessions_sharing_a_system_prompt_are_separated():
    a = turns_of(conversation(4, tag="Please fix alpha: "), prefix="a", t0=0.0, step=2.0)
    b = turns_of(conversation(4, tag="Please fix beta: "), prefix="b", t0=1.0, step=2.0)
    sessions = group_sessions(interleave(a, b))
    assert [[t.request_id for t in s.turns] for s in sessions] == [
        ["a0", "a1", "a2", "a3"],
        ["b0", "b1", "b2", "b3"],
    ]
    assert all(s.inferred for s in sessions)
    reports = analyze(interleave(a, b), tokenizer="regex")
    assert all(r.append_only for r in reports)


def test_sessions_with_a_rewritten_system_prompt_are_still_inferred():
    a = turns_of(conversation(3, system=lambda i: stale_system(i + 2), tag="Please fix alpha: "), prefix="a", step=2.0)
    b = turns_of(conversation(3, system=lambda i: stale_system(i + 2), tag="Please fix beta: "), prefix="b", t0=1.0, step=2.0)
    sessions = group_sessions(interleave(a, b))
    assert [[t.request_id for t in s.turns] for s in sessions] == [["a0", "a1", "a2"], ["b0", "b1", "b2"]]


def test_explicit_session_ids_win():
    a = turns_of(conversation(2), session="x", prefix="x")
    b = turns_of(conversation(2), session="y", prefix="y", t0=0.5)
    sessions = group_sessions(sorted(a + b, key=lambda t: t.started_at))
    assert [(s.id, s.inferred, len(s.turns)) for s in sessions] == [("x", False, 2), ("y", False, 2)]


# -- report and check ---------------------------------------------------------


def test_analyze_db_reports_per_turn(tmp_path):
    db = tmp_path / "t.db"
    turns = turns_of(conversation(3, system=lambda i: stale_system(i + 2)), session="s")
    turns[1].prompt_tokens, turns[1].cached_tokens = 100, 20
    with Recorder(db) as rec:
        for t in turns:
            rec.record(t)
    (rep,) = analyze(db, tokenizer="regex")
    assert rep.session_id == "s" and not rep.inferred and not rep.append_only
    first, second, _ = rep.turns
    assert first.note == "first" and first.common_tokens == 0
    assert second.divergence.message_index == 0
    assert second.reprefill_tokens == 100 - second.common_tokens
    text = format_text([rep])
    assert "msg 0 @ char" in text and "regex-words" in text
    assert " ? " in text  # unknown cached tokens
    data = json.loads(to_json([rep]))
    assert data[0]["turns"][0]["cached_tokens"] is None
    assert data[0]["turns"][1]["divergence"]["message_index"] == 0


def test_unrenderable_turns_are_skipped_not_compared():
    turns = turns_of(conversation(3), session="s")
    turns.insert(1, Turn("raw", 0.5, "/v1/chat/completions", "u", "{broken", session_id="s"))
    (rep,) = analyze(turns, tokenizer="regex")
    assert [t.note for t in rep.turns] == ["first", "unrenderable", "", ""]
    assert rep.append_only


def test_check_passes_on_append_only_and_fails_on_divergent(tmp_path):
    ok, problems = check(FIXTURES / "append_only.jsonl")
    assert ok and problems == []
    ok, problems = check(FIXTURES / "todo_stale.jsonl")
    assert not ok and len(problems) == 3
    p = problems[0]
    assert (p.session_id, p.index, p.prev_request_id) == ("todo-stale", 1, "todo-stale-0")
    assert p.divergence.message_index == 0
    assert "msg 0" in str(p) and "3 turns" in str(p)


def test_check_reads_a_database_too(tmp_path):
    db = tmp_path / "t.db"
    with Recorder(db) as rec:
        for t in turns_of(conversation(3), session="s"):
            rec.record(t)
    assert check(db) == (True, [])


def test_analyze_unknown_session_raises():
    with pytest.raises(InvalidRequest):
        analyze(FIXTURES / "append_only.jsonl", session="nope", tokenizer="regex")

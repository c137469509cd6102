"""Issue 26, item 7: sessions without ids. A request that starts a new conversation (its history is not
an extension or an edit of the previous one: one user message again, with the same system prompt) opens
a new inferred session instead of being chained as a break; real harness traffic (fixtures/traffic/,
recorded through the proxy) interleaved and stripped of its session ids gives the same sessions and the
same causes as with ids."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from analyzer import analyze, check
from analyzer.load import request_from_record
from prefixtrace.cli import cli

ROOT = Path(__file__).resolve().parents[1]
TRAFFIC = ROOT / "fixtures" / "traffic"
QWEN3 = str(ROOT / "fixtures" / "qwen3.jinja")


def _records(name: str) -> list[dict]:
    return [json.loads(line) for line in (TRAFFIC / name).read_text().splitlines() if line.strip()]


def _pi_conversations(name: str) -> list[dict]:
    """pi run twice: one conversation over chat completions, then one over the Messages API. pi sends no
    session id; the truth is which API each request went over, written here as an explicit id."""
    return [{**r, "session": "pi-" + ("messages" if r["endpoint"] == "/v1/messages" else "chat")}
            for r in _records(name)]


def _interleave(*streams: list[dict]) -> list[dict]:
    """The streams' requests alternating (a, b, a, b, …), re-timed one second apart in that order."""
    out, i = [], 0
    while any(i < len(s) for s in streams):
        out += [s[i] for s in streams if i < len(s)]
        i += 1
    return [{**r, "ts": 1_800_000_000.0 + n} for n, r in enumerate(out)]


def _stripped(records: list[dict]) -> list[dict]:
    return [{**r, "session": None} for r in records]


def _shape(records: list[dict]) -> list[tuple]:
    """Sessions as the turns they hold and each turn's cause, in the order of their first turn."""
    report = analyze([request_from_record(r, i + 1, "t") for i, r in enumerate(records)], template=QWEN3)
    shape = [(tuple(t.request_id for t in s.turns),
              tuple((t.brk.cause, t.brk.subtype) if t.brk else None for t in s.turns)) for s in report.sessions]
    return sorted(shape, key=lambda s: min(s[0]))


def _by_api(name: str) -> list[list[dict]]:
    recs = _pi_conversations(name)
    return [[r for r in recs if r["session"] == "pi-chat"], [r for r in recs if r["session"] == "pi-messages"]]


def test_pi_run_twice_once_per_api_is_two_sessions_without_a_break():
    # The second conversation starts with the same system prompt and user message over the Messages API:
    # it was chained onto the first as `tools_change` at token 110 while the engine served it from cache.
    for name in ("pi_tiny.jsonl", "pi_smol.jsonl"):
        report = analyze(TRAFFIC / name, template=QWEN3)
        assert report.breaks == [], [(s.id, t.number, t.brk.cause) for s, t in report.breaks]
        main = [s for s in report.sessions if s.kind == "main"]
        assert len(main) == 2 and all(s.inferred for s in main)
        endpoints = {r["id"]: r["endpoint"] for r in _records(name)}
        for s in main:
            assert len({endpoints[t.request_id] for t in s.turns}) == 1  # one API per conversation
        assert _shape(_records(name)) == _shape(_pi_conversations(name))
    result = CliRunner().invoke(cli, ["check", str(TRAFFIC / "pi_tiny.jsonl"), "--template", QWEN3])
    assert result.exit_code == 0, result.output


def test_the_same_opening_again_in_one_api_is_a_new_session_too():
    # pi run twice over chat completions: the second run's first request is the first run's first
    # request again (same system prompt, same user message, same tools).
    chat = _by_api("pi_tiny.jsonl")[0]

    def second_run(r: dict) -> dict:  # the model answers differently the second time
        msgs = [{**m, "content": f"{m['content']} (second run)"} if m.get("role") == "assistant" else m
                for m in r["request"]["messages"]]
        return {**r, "id": r["id"] + "-again", "session": "pi-chat-2", "request": {**r["request"], "messages": msgs}}

    again = [second_run(r) for r in chat]
    records = [*chat, *again]
    for n, r in enumerate(records):
        r["ts"] = 1_800_000_000.0 + n
    assert _shape(_stripped(records)) == _shape(records)
    report = analyze([request_from_record(r, i + 1, "t") for i, r in enumerate(_stripped(records))],
                     template=QWEN3)
    assert [len(s.turns) for s in report.sessions] == [3, 3] and report.breaks == []


def test_one_task_run_twice_at_once_is_two_sessions():
    # Two runs of one pi task in parallel (an eval harness): the same opening twice, then replies that
    # differ. The repeated opening joined the first run as a retry; when the second run's first reply
    # differs, it is another conversation and takes its opening with it.
    chat = _by_api("pi_tiny.jsonl")[0]
    second = [{**r, "id": r["id"] + "-b", "session": "pi-chat-b", "request": {**r["request"], "messages": [
        {**m, "content": f"{m['content']} (run b)"} if m.get("role") == "assistant" else m
        for m in r["request"]["messages"]]}} for r in chat]
    records = _interleave(chat, second)
    assert records[0]["request"] == records[1]["request"]  # byte-identical openings
    assert _shape(_stripped(records)) == _shape(records)
    assert [len(turns) for turns, _ in _shape(_stripped(records))] == [3, 3]


def test_interleaved_pi_conversations_without_ids_match_with_ids():
    records = _interleave(*_by_api("pi_tiny.jsonl"))
    assert [r["session"] for r in records[:4]] == ["pi-chat", "pi-messages", "pi-chat", "pi-messages"]
    assert _shape(_stripped(records)) == _shape(records)


def test_interleaved_real_sessions_of_different_harnesses_match_with_ids():
    claude = [r for r in _records("claude_tiny.jsonl") if r["session"]]  # its two conversations (ids)
    assert len({json.loads(r["session"])["session_id"] for r in claude}) >= 2
    cases = [
        (claude, _by_api("pi_tiny.jsonl")[0]),
        (_by_api("pi_tiny.jsonl")[1], [r for r in _records("claude_smol.jsonl")]),
        (_by_api("pi_smol.jsonl")[0], _by_api("pi_tiny.jsonl")[1], _records("codex_responses_smol.jsonl")),
    ]
    for streams in cases:
        records = _interleave(*streams)
        with_ids = _shape(records)
        assert _shape(_stripped(records)) == with_ids
    # The causes survive too: claude_smol's resume is a dropped_message with and without ids.
    records = _interleave(_by_api("pi_tiny.jsonl")[1], _records("claude_smol.jsonl"))
    causes = [c for _, cs in _shape(_stripped(records)) for c in cs if c]
    assert ("dropped_message", "user") in causes


def test_a_compaction_still_continues_its_session_but_a_fresh_task_does_not():
    # A compaction replaces the history with a summary (one user message that says so): it continues the
    # session. A new task with the same system prompt and tools is a new conversation, not a compaction.
    rec = _records("pi_tiny.jsonl")[:3]
    bodies = [r["request"] for r in rec]
    system = bodies[2]["messages"][0]
    summary = {**bodies[2], "messages": [system, {"role": "user", "content": "Summary of the conversation so far: "
                                                                             "the user asked to read files."}]}
    fresh = {**bodies[2], "messages": [system, {"role": "user", "content": "Write a haiku about caches."}]}
    from analyzer.load import Request

    compacted = analyze([Request(f"r{i}", float(i), b, None) for i, b in enumerate([*bodies, summary])],
                        template=QWEN3)
    assert [len(s.turns) for s in compacted.sessions] == [4]
    assert compacted.sessions[0].turns[3].brk.cause == "compaction"
    new = analyze([Request(f"r{i}", float(i), b, None) for i, b in enumerate([*bodies, fresh])], template=QWEN3)
    assert [len(s.turns) for s in new.sessions] == [3, 1] and new.breaks == []
    assert check([Request(f"r{i}", float(i), b, None) for i, b in enumerate([*bodies, fresh])],
                 template=QWEN3).ok


def test_interleaved_compaction_goes_to_the_conversation_whose_tail_it_kept():
    # Two conversations of one agent (same system prompt and tools), alternating; A compacts right after
    # B's request, keeping its last exchange after the summary as pi does. It was taken for a compaction
    # of whichever conversation was most recently active: B.
    body = _records("pi_tiny.jsonl")[2]["request"]
    system, tools = body["messages"][0], body["tools"]

    def conv(tag: str, n: int) -> list[dict]:
        msgs = [system, {"role": "user", "content": f"task {tag} " * 30}]
        for i in range(n):
            msgs += [{"role": "assistant", "content": f"{tag} step {i} " * 20}, {"role": "user", "content": f"go {tag}{i}"}]
        return msgs

    from analyzer.load import Request

    bodies = []
    for i in range(1, 4):
        bodies += [("A", conv("A", i)), ("B", conv("B", i))]
    summary = {"role": "user", "content": "The conversation history before this point was compacted into the "
                                          "following summary: task A, three steps done."}
    bodies.append(("A", [system, summary, *conv("A", 3)[-2:]]))
    bodies.append(("B", conv("B", 4)))
    records = [{"id": f"r{i}", "session": tag, "ts": 1_800_000_000 + i, "request": {"messages": m, "tools": tools}}
               for i, (tag, m) in enumerate(bodies)]
    with_ids = _shape(records)
    assert _shape(_stripped(records)) == with_ids
    assert [c for _, cs in with_ids for c in cs if c] == [("compaction", None)]
    reqs = [Request(r["id"], float(i), r["request"], None) for i, r in enumerate(records)]
    by_first = {s.turns[0].request_id: s for s in analyze(reqs, template=QWEN3).sessions}
    assert [t.request_id for t in by_first["r0"].turns] == ["r0", "r2", "r4", "r6"]

"""A miss of real size never costs "0.00 s": under load its TTFT can fall below its cache hits' (they
queued longer), and then the prefill rate measured from the session's turns prices it, with that basis."""

from __future__ import annotations

import json

from analyzer import analyze


def _session(tmp_path, break_ttft: float):
    notes = " ".join(f"note {i} about widget {i * 7}." for i in range(150))
    history = [{"role": "user", "content": "List the files."}]
    rows = []
    for i in range(4):
        system = {"role": "system", "content": f"You are an agent. {'Mode: fast.' if i == 3 else ''} {notes}"}
        rows.append({"messages": [system, *history]})
        history = history + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"Step {i}."}]
    n = [t.prompt_tokens for t in analyze([r for r in rows]).sessions[0].turns]
    # The first turn prefilled everything in 4 s; the two hits waited 5 s in a queue; the break was quick.
    timing = [(0, 4.0), (n[0], 5.0), (n[1], 5.0), (0, break_ttft)]
    src = tmp_path / "queued.jsonl"
    src.write_text("".join(json.dumps({"session": "s", "ts": 10 + i, "request": body,
                                       "tokens": {"prompt": n[i], "cached": cached}, "timing": {"ttft_s": ttft}}) + "\n"
                           for i, (body, (cached, ttft)) in enumerate(zip(rows, timing))))
    return analyze(src)


def test_a_miss_faster_than_its_queued_hits_is_priced_at_the_measured_rate(tmp_path):
    (_, t), = _session(tmp_path, break_ttft=1.0).breaks
    assert t.lost_tokens > 1000
    assert t.lost_seconds > 1.0  # was 0.00: TTFT 1.0 s against the hits' 5.0 s
    assert t.lost_seconds_basis.startswith("prefill rate ") and "says less than 10% of that" in t.lost_seconds_basis


def test_a_miss_slower_than_its_hits_keeps_the_ttft_difference(tmp_path):
    (_, t), = _session(tmp_path, break_ttft=9.0).breaks
    assert t.lost_seconds == 4.0 and t.lost_seconds_basis.startswith("TTFT 9.00 s against 5.00 s")

"""The text report opens with what to fix, as the Markdown and HTML reports do: one line per cause and
fix (its seconds, tokens and turns), each fix said once; a one-token server "miss" on an identical
prompt (the engine recomputes the last prompt token) is no break; counted nouns read right."""

from __future__ import annotations

import json

from click.testing import CliRunner

from analyzer import analyze
from prefixtrace.cli import cli

TOKENIZER = "fixtures/tiny-llama/tokenizer.json"


def _ticking(tmp_path, turns: int = 5):
    """One session whose system prompt carries a clock that ticks every turn, timed so each break is priced."""
    notes = " ".join(f"note {i} about widget {i * 7}." for i in range(60))
    rows, history = [], [{"role": "user", "content": "List the files."}]
    for i in range(turns):
        system = {"role": "system", "content": f"You are an agent. Time: 10:00:0{i}. {notes}"}
        rows.append({"session": "agent", "ts": 1000 + i, "request": {"messages": [system, *history]},
                     "timing": {"ttft_s": 0.5 + 0.1 * i}})
        history = history + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"Step {i}."}]
    src = tmp_path / "ticking.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


def test_the_text_report_opens_with_each_fix_once(tmp_path):
    src = _ticking(tmp_path)
    text = CliRunner().invoke(cli, ["analyze", str(src), "--prefill-rate", "1000"]).output
    lines = text.splitlines()
    assert lines[0].startswith("What to fix: 4 cache breaks cost ")
    assert lines[1].startswith("  1. ") and "4 breaks: system prompt rewritten (volatile:timestamp)" in lines[1]
    assert "session agent turns 2, 3, 4, 5" in lines[1] and "fix: the system prompt carries a timestamp" in lines[1]
    # The fix is said once; each break below refers to it by number.
    assert text.count("the system prompt carries a timestamp") == 1
    assert text.count("fix: #1 above") == 4


def test_nouns_are_singular_when_one(tmp_path):
    src = _ticking(tmp_path, turns=2)
    text = CliRunner().invoke(cli, ["analyze", str(src), "--prefill-rate", "1000"]).output
    assert "What to fix: 1 cache break cost" in text and "2 turns, 1 break," in text
    assert "(s)" not in text and "1 breaks" not in text and "1 turns" not in text


def test_a_one_token_shortfall_on_an_identical_prompt_is_no_break(tmp_path):
    """An engine serves an identical prompt n-1 tokens from cache: the last token is computed again for its
    logits. Counted with the server's tokenizer, that is no server miss; two tokens short still is."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    n = analyze([{"messages": messages}], tokenizer=TOKENIZER).sessions[0].turns[0].prompt_tokens

    def report(cached: int):
        rows = [{"session": "s", "ts": 1 + i, "request": {"messages": messages},
                 "tokens": {"prompt": n, "cached": c}} for i, c in enumerate((0, cached))]
        src = tmp_path / f"same-{cached}.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return analyze(src, tokenizer=TOKENIZER)

    assert report(n - 1).breaks == []
    (_, turn), = report(n - 2).breaks
    assert turn.brk.cause == "server_miss" and turn.lost_tokens == 2

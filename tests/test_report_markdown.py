"""`analyze --format markdown`: a report to paste into a GitHub issue (issue 26, item 5): the headline
keeps breaks apart from appends, a table per cause, the fixes with their turns, the top breaks with
their fix text and a short diff in a fenced block; client text cannot break the table or the fence."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from analyzer.markdown import render
from prefixtrace.cli import cli
from tests.test_report_html import _recording, _synthetic


def test_markdown_report_of_a_recording(tmp_path):
    src = _recording(tmp_path / "rec.jsonl")
    result = CliRunner().invoke(cli, ["analyze", str(src), "--format", "markdown", "--prefill-rate", "1000"])
    assert result.exit_code == 0, result.output
    md = result.output
    d = json.loads(CliRunner().invoke(cli, ["analyze", str(src), "--format", "json", "--prefill-rate", "1000"]).output)
    breaks = [t for s in d["sessions"] for t in s["turns"] if t["break"]]
    lost = sum(t["break"]["saves_tokens"] for t in breaks)
    headline = md.splitlines()[2]
    assert headline.startswith("**4 cache breaks** cost **") and f"**{lost:,} re-prefilled tokens**" in headline
    assert f"{d['totals']['reprefill_tokens']:,}" not in headline  # appends are said apart
    assert "| cause | breaks | seconds lost | tokens re-prefilled |" in md
    assert re.search(r"^\| system prompt rewritten \(`system_rewrite`\) \| 3 \| [\d.]+ s \| [\d,]+ \|$", md, re.M)
    # The same fix is one line listing its turns, costliest first.
    assert re.search(r"- \*\*system prompt rewritten \(volatile[^)]*\)\*\* .*turns 10, 7, 4$", md, re.M)
    # Top breaks: fix text, and a short diff showing the changed counter.
    assert "### Top 4 breaks by cost" in md and "Fix: the tool list changed" in md
    blocks = re.findall(r"```diff\n(.*?)\n\s*```", md, re.S)
    assert len(blocks) == 4
    assert any("Todo: 2 of 9" in b and "Todo: 3 of 9" in b for b in blocks)
    assert all(len(line) < 320 for b in blocks for line in b.splitlines())


def test_markdown_keeps_client_text_in_its_place():
    d = _synthetic(120, every=50)
    brk = d["sessions"][0]["turns"][50]["break"]
    brk["before"] = "a | b\n```\n<img src=x> " + "z" * 40
    brk["after"] = "a | c\n```\n<img src=x> " + "z" * 40
    d["sessions"][0]["id"] = "evil | id\nwith `ticks`"
    md = render(d)
    blocks = re.findall(r"^\s*(`{3,})diff\n(.*?)\n\s*\1$", md, re.M | re.S)
    planted = [fence for fence, body in blocks if "<img src=x>" in body]
    assert planted == ["````"]  # longer than the ``` inside, so the block holds all of it
    for line in md.splitlines():
        if line.startswith("| "):
            assert line.count(" | ") - line.count("\\| ") == 3  # four cells, whatever the client sent
    assert "evil \\| id with" in md  # one line, pipe escaped

"""`prefixtrace analyze` / `check` end to end, and the HTML report in a real headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner

from prefixtrace.cli import cli

ROOT = Path(__file__).resolve().parents[1]
SESSIONS = ROOT / "fixtures" / "sessions"
TEMPLATES = ROOT / "fixtures" / "templates"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_analyze_json_with_template_block_size_and_rate(tmp_path):
    out = tmp_path / "r.json"
    result = CliRunner().invoke(cli, ["analyze", str(SESSIONS / "cause_thinking_strip.jsonl"), "--template",
                                      str(TEMPLATES / "qwen3_style.jinja"), "--block-size", "16",
                                      "--prefill-rate", "300", "--format", "json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["renderer"] == "template:qwen3_style.jinja"
    assert report["sessions"][0]["turns"][1]["break"]["cause"] == "thinking_strip"
    assert report["totals"]["by_cause"]["thinking_strip"]["seconds"] >= 0


def test_analyze_text_says_which_renderer_and_tokenizer():
    result = CliRunner().invoke(cli, ["analyze", str(SESSIONS / "todo_stale.jsonl")])
    assert result.exit_code == 0, result.output
    assert "generic-chatml" in result.output and "tiktoken:o200k_base" in result.output
    assert "system_rewrite cost" in result.output


def test_check_allow_and_junit(tmp_path):
    junit = tmp_path / "j.xml"
    runner = CliRunner()
    bad = runner.invoke(cli, ["check", str(SESSIONS / "cause_compaction.jsonl"), "--junit", str(junit)])
    assert bad.exit_code == 1 and "compaction" in bad.output
    suite = ET.parse(junit).getroot()
    assert suite.get("failures") == "1" and suite.find("testcase/failure").get("type") == "compaction"
    ok = runner.invoke(cli, ["check", str(SESSIONS / "cause_compaction.jsonl"), "--allow", "compaction,request_local_tail"])
    assert ok.exit_code == 0, ok.output
    unknown = runner.invoke(cli, ["check", str(SESSIONS / "append_only.jsonl"), "--allow", "bogus"])
    assert unknown.exit_code == 1 and "unknown cause" in unknown.output


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed")
def test_html_report_renders_in_headless_chromium(tmp_path):
    src = tmp_path / "all.jsonl"
    src.write_text("".join((SESSIONS / f"cause_{n}.jsonl").read_text() for n in
                           ("system_rewrite_volatile", "history_edit", "compaction", "append_only")))
    out = tmp_path / "r.html"
    result = CliRunner().invoke(cli, ["analyze", str(src), "--format", "html", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "http" not in out.read_text().replace("http://www.w3.org/2000/svg", "")  # self-contained
    with tempfile.TemporaryDirectory() as profile:
        args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}"]
        dom = subprocess.run([*args, "--dump-dom", out.as_uri()], capture_output=True, text=True, timeout=60).stdout
        shot = tmp_path / "shot.png"
        subprocess.run([*args, f"--screenshot={shot}", "--window-size=1200,900", out.as_uri()],
                       capture_output=True, timeout=60)
    assert 'data-rendered="4"' in dom  # the script ran and found four session timelines
    assert dom.count('class="break"') == 3 and 'data-cause="compaction"' in dom
    assert shot.is_file() and shot.stat().st_size > 1000

"""`prefixtrace compare`: two recordings side by side, or one grouped by harness version, with deltas,
in text, JSON, Markdown and HTML, exiting 1 when a miss rate rose past --max-regression."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TRAFFIC = Path("/work/shared/traffic/claude_tiny.jsonl")
ROOT = Path(__file__).resolve().parents[1]


def _real() -> list[dict]:
    return [json.loads(line) for line in TRAFFIC.read_text().splitlines()]


def _regressed(version: str) -> list[dict]:
    """The same real Claude Code session as a later release that re-stamps a counter in the system prompt
    every turn (the shape of a harness regression), under its own User-Agent."""
    out = []
    for n, r in enumerate(_real()):
        r = json.loads(json.dumps(r))
        r["id"] = f"{r.get('id')}-{version}"
        r["ts"] = r["ts"] + 86_400  # a day later, its own sessions
        if r.get("session"):
            r["session"] = f"{r['session']}-{version}"
        for key in ("usage", "tokens"):  # what the server said of the original run does not apply
            r.pop(key, None)
        headers = r.get("request_headers") or {}
        if "claude-cli" in headers.get("user-agent", ""):
            headers["user-agent"] = f"claude-cli/{version} (external, sdk-cli)"
        body = r.get("request")
        if isinstance(body, dict) and isinstance(body.get("system"), list) and body["system"]:
            block = body["system"][-1]
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                block["text"] += f"\nTurn counter: {n}"
        out.append(r)
    return out


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    """In process (the analysis is what takes time, not the interpreter's start); stdout and stderr apart."""
    from click.testing import CliRunner

    from prefixtrace.cli import cli

    result = CliRunner().invoke(cli, ["compare", *args])
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def _process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", "compare", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_two_recordings_side_by_side_and_the_gate(tmp_path):
    before = _write(tmp_path / "before.jsonl", _real())
    after = _write(tmp_path / "after.jsonl", _regressed("2.1.198"))
    same = _cli(str(before), str(before), "--max-regression", "5")
    assert same.returncode == 0, same.stderr
    assert "no miss rate rose by more than 5 points" in same.stdout
    worse = _cli(str(before), str(after), "--max-regression", "5")
    assert worse.returncode == 1, worse.stdout + worse.stderr
    assert "REGRESSION: miss rate rose" in worse.stdout and "system_rewrite" in worse.stdout
    out = _cli(str(before), str(after), "--format", "json")
    assert out.returncode == 0  # no gate asked
    data = json.loads(out.stdout)
    a, b = data["sides"]
    assert b["miss_rate"] > a["miss_rate"] and data["deltas"][0]["miss_rate"] == round(b["miss_rate"] - a["miss_rate"], 4)
    assert b["by_cause"]["system_rewrite"]["misses"] > 0 and "retry" in b["by_kind"]


def test_one_recording_by_version_in_markdown_and_html(tmp_path):
    both = _write(tmp_path / "both.jsonl", _real() + _regressed("2.1.198"))
    md = _cli(str(both), "--by", "version", "--format", "markdown", "--max-regression", "10")
    assert md.returncode == 1
    lines = md.stdout.splitlines()
    assert lines[0] == "|  | claude-code 2.1.197 | claude-code 2.1.198 | Δ (last two) |"
    assert any(line.startswith("| miss rate |") for line in lines) and "**REGRESSION: miss rate rose" in md.stdout
    page = tmp_path / "c.html"
    html = _cli(str(both), "--by", "version", "--format", "html", "--out", str(page))
    assert html.returncode == 0 and "<th>claude-code 2.1.198</th>" in page.read_text()


def test_bad_arguments_are_one_line(tmp_path):
    src = _write(tmp_path / "a.jsonl", _real())
    r = _process(str(src))
    assert r.returncode == 2 and "give two sources (A B), or one with --by" in r.stderr
    assert "Traceback" not in r.stderr

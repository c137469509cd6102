"""The live dashboard names the providers' rules the rendered prompt does not show, as `analyze` does:
a changed thinking budget (`param_change/thinking.budget_tokens`) and a breakpoint more than 20 blocks past
the session's newest cache write (`lookback`), for Messages requests a real proxy relays to an upstream."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request

from proxy.app import create_app
from proxy.upstream_backend import UpstreamBackend
from tests.conftest import running_server
from tests.test_dashboard import ARTIFACTS, browser  # noqa: F401  (the Chromium fixture)

SHOT = ARTIFACTS / "dashboard_param_change_lookback.png"  # docs/results/ keeps a copy
SYSTEM = [{"type": "text", "text": "You are a coding agent working in /home/dev/project. " * 20,
           "cache_control": {"type": "ephemeral"}}]
CLAUDE_CODE = "claude-cli/2.1.197 (external, sdk-cli)"  # as in /work/shared/traffic/claude_tiny.jsonl
TOOLS = [{"name": "Read", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]


def _anthropic_upstream() -> FastAPI:
    """A Messages upstream (what the proxy fronts for Claude Code), answering every request alike."""
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages(request: Request):
        await request.json()
        return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude", "stop_reason": "end_turn",
                "stop_sequence": None, "content": [{"type": "text", "text": "Done."}],
                "usage": {"input_tokens": 40, "output_tokens": 2}}

    return app


def _text(text: str, cached: bool = False) -> dict:
    block = {"type": "text", "text": text}
    return {**block, "cache_control": {"type": "ephemeral"}} if cached else block


def _thinking_session() -> list[dict]:
    """Two turns of one conversation; the second raises the thinking budget (Claude Code's effort toggle)."""
    first = [{"role": "user", "content": [_text("Fix the flaky login test", cached=True)]}]
    second = [{"role": "user", "content": [_text("Fix the flaky login test")]},
              {"role": "assistant", "content": [_text("Done.")]},
              {"role": "user", "content": [_text("Now think harder about the retry loop", cached=True)]}]
    return [{"model": "claude", "max_tokens": 4096, "system": SYSTEM, "tools": TOOLS, "messages": messages,
             "thinking": {"type": "enabled", "budget_tokens": budget}}
            for messages, budget in ((first, 1024), (second, 2048))]


def _lookback_session() -> list[dict]:
    """A turn, then one answering 12 parallel reads at once with its only new breakpoint on a note after the
    results: 25 blocks (12 calls, 12 results, the note) past the first turn's breakpoint."""
    opening = {"role": "user", "content": [_text("Read every module under src/", cached=True)]}
    calls = [{"type": "tool_use", "id": f"toolu_{i:02d}", "name": "Read", "input": {"path": f"src/m{i}.py"}}
             for i in range(12)]
    results = [{"type": "tool_result", "tool_use_id": f"toolu_{i:02d}", "content": f"def f{i}(): return {i}"}
               for i in range(12)]
    second = [{"role": "user", "content": [_text("Read every module under src/")]},
              {"role": "assistant", "content": calls},
              {"role": "user", "content": [*results, _text("Now summarise them.", cached=True)]}]
    return [{"model": "claude", "max_tokens": 1024, "system": SYSTEM, "tools": TOOLS, "messages": messages}
            for messages in ([opening], second)]


def _lookback_after_a_turn_without_breakpoint() -> list[dict]:
    """The newest write is two requests back: the middle request marks no block (the session's write
    stays where the first left it, after block 3), the third's breakpoint is 27 blocks past it."""
    first, batch = _lookback_session()
    asked = [{"role": "user", "content": [_text("Read every module under src/")]},
             {"role": "assistant", "content": [_text("All of them?")]},
             {"role": "user", "content": [_text("Yes, all.")]}]
    middle = {**first, "messages": asked}
    last = {**first, "messages": [*asked, *batch["messages"][1:]]}
    return [first, middle, last]


def _drive(url: str) -> dict[str, dict]:
    for session, bodies in (("thinking-1", _thinking_session()), ("lookback-1", _lookback_session()),
                            ("lookback-2", _lookback_after_a_turn_without_breakpoint())):
        for body in bodies:
            r = httpx.post(url + "/v1/messages", json=body, headers={"X-Claude-Code-Session-Id": session, "User-Agent": CLAUDE_CODE},
                           timeout=30)
            assert r.status_code == 200, r.text
    sessions = httpx.get(url + "/ui/api/sessions", timeout=30).json()["sessions"]
    return {s["id"]: s for s in sessions}


@pytest.mark.slow  # two servers
def test_live_analysis_names_param_change_and_lookback(recorder):
    with running_server(_anthropic_upstream()) as upstream:
        with running_server(create_app(UpstreamBackend(upstream + "/v1"), recorder)) as url:
            sessions = _drive(url)
    brk = sessions["thinking-1"]["turns"][1]["analysis"]["break"]
    assert (brk["cause"], brk["subtype"]) == ("param_change", "thinking.budget_tokens")
    assert "1024" in brk["before"] and "2048" in brk["after"]
    brk = sessions["lookback-1"]["turns"][1]["analysis"]["break"]
    assert brk["cause"] == "lookback" and "25 blocks later" in brk["after"], brk
    assert "Anthropic looks back only 20" in brk["suggestion"]
    # The write two requests back still counts, as `analyze` keeps it (the session's writes, not the pair's).
    turns = sessions["lookback-2"]["turns"]
    assert turns[2]["analysis"]["break"]["cause"] == "lookback", turns[2]["analysis"]


@pytest.mark.slow
def test_dashboard_shows_param_change_and_lookback(recorder, browser):  # noqa: F811
    with running_server(_anthropic_upstream()) as upstream:
        with running_server(create_app(UpstreamBackend(upstream + "/v1"), recorder)) as url:
            _drive(url)
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(url + "/ui")
            shown = {}
            for session in ("thinking-1", "lookback-1"):
                brk = page.wait_for_selector(f'.session[data-session="{session}"] .break', timeout=15_000)
                shown[session] = brk.text_content()
            SHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SHOT), full_page=True)
    assert "thinking.budget_tokens" in shown["thinking-1"], shown
    assert "lookback" in shown["lookback-1"] and "25 blocks later" in shown["lookback-1"], shown

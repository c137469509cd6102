"""GET /ui in real headless Chromium: two turns through the proxy appear live, with the break's diff."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield browser
        browser.close()


def chat(url: str, messages: list, **extra) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 8, "temperature": 0, **extra},
                   headers={"X-Session-Id": "agent-1"})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_dashboard_shows_turns_and_breaks_live(engine_server, browser):
    url, _ = engine_server
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(url + "/ui")
    page.wait_for_selector("#empty")
    page.wait_for_selector("#engine-panel:not([hidden])")
    assert page.text_content("#running") == "0"

    messages = [{"role": "system", "content": "You are terse. Today is Monday."},
                {"role": "user", "content": "Name a colour."}]
    first = chat(url, messages)
    page.wait_for_selector('.session[data-session="agent-1"] .bar[data-turn="0"]', timeout=10_000)
    messages = [{"role": "system", "content": "You are terse. Today is Tuesday."}, messages[1],
                {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "Another."}]
    chat(url, messages)  # same page, no reload: the poll brings the second turn
    page.wait_for_selector('.session[data-session="agent-1"] .bar[data-turn="1"].has-break', timeout=10_000)
    brk = page.wait_for_selector('.break[data-turn="1"]', timeout=10_000)
    assert "system_rewrite" in brk.text_content()
    assert page.text_content('.break[data-turn="1"] .diff del') == "Mon"  # the differing characters only
    assert page.text_content('.break[data-turn="1"] .diff ins') == "Tues"
    # Both bars carry a re-prefilled segment; the second one has a cached part too (engine-reported).
    assert "re-prefilled" in page.get_attribute('.bar[data-turn="1"]', "title")
    assert page.text_content("#proxy-requests") == "2"
    # Render policies per turn (issue 9), in words, in the clicked turn's detail (issue 26: no jargon).
    page.click('.session[data-session="agent-1"] .bar[data-turn="1"]')
    assert "earlier reasoning" in page.text_content('.turn-detail[data-turn="1"] .policy')
    assert "mid_system=" not in page.inner_text("body")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)


def test_dashboard_api_escapes_nothing_and_page_uses_text_only(engine_server):
    """Prompts are untrusted: the API returns them raw, the page only ever sets textContent."""
    url, _ = engine_server
    chat(url, [{"role": "user", "content": "<img src=x onerror=alert(1)>"}])
    data = httpx.get(url + "/ui/api/sessions").json()
    assert data["sessions"][0]["id"] == "agent-1"
    assert data["sessions"][0]["turns"][0]["analysis"]["note"] == "first"
    policy = data["sessions"][0]["turns"][0]["policy"]  # what the engine's render policies did (issue 9)
    assert policy["mid_system"] == "inline" and policy["thinking_retention"] in ("loop", "template")
    page = httpx.get(url + "/ui").text
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page


def test_dashboard_api_never_shows_a_secret(engine_server):
    """The live analysis sees turns before the recorder redacts them: what it serves (session
    ids, the break's before/after text) is masked the same way."""
    url, _ = engine_server
    old, new = "sk-proj-" + "A1b2C3d4" * 6, "sk-proj-" + "Z9y8X7w6" * 6
    session = "ghp_" + "a1B2c3D4e5" * 4
    for key in (old, new):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"X-Session-Id": session},
                       json={"max_tokens": 2, "temperature": 0, "messages": [
                           {"role": "system", "content": f"Deploy with key {key} today."},
                           {"role": "user", "content": "Go."}]})
        assert r.status_code == 200, r.text
    text = httpx.get(url + "/ui/api/sessions").text
    for secret in (old, new, session):
        assert secret not in text
    data = httpx.get(url + "/ui/api/sessions").json()
    turns = data["sessions"][0]["turns"]
    assert len(turns) == 2 and "[REDACTED]" in data["sessions"][0]["id"]

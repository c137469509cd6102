"""`analyze --format html` as a person uses it (issue 26, items 5 and 8), in headless Chromium: the page
opens on what the breaks cost, one card per cause and fix (not one per turn), top breaks that link
to their detail, a timeline with axes whose break marks open the diff, a sortable and filterable turn
table, the differing characters marked; self-contained, and usable at 10,000 turns."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from analyzer.report_html import render
from prefixtrace.cli import cli
from tests.test_dashboard import ARTIFACTS, browser  # noqa: F401  (the Chromium fixture)

TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} a file",
                                           "parameters": {"type": "object", "properties": {}}}} for n in ("read", "edit")]


def _recording(path: Path) -> Path:
    """One agent session of 13 turns: the system prompt's todo counter ticks at turns 4, 7 and 10 (the same
    cause and fix three times), and at turn 12 a tool is added at the head of the list."""
    records, messages, counter, tools = [], [{"role": "user", "content": "Make the login test pass"}], 0, TOOLS
    for turn in range(1, 14):
        if turn in (4, 7, 10):
            counter += 1
        if turn == 12:
            tools = [{"type": "function", "function": {"name": "grep", "description": "grep files",
                                                       "parameters": {"type": "object", "properties": {}}}}, *TOOLS]
        system = f"You are a coding agent. Work carefully and explain nothing.\nTodo: {counter} of 9 done."
        body = {"model": "m", "tools": tools, "messages": [{"role": "system", "content": system}, *messages]}
        records.append({"id": f"r{turn}", "session": "agent-7", "ts": 1_700_000_000 + 10 * turn, "request": body})
        messages = [*messages, {"role": "assistant", "content": f"Step {turn}: " + "looked at the code. " * 30},
                    {"role": "user", "content": f"go on with step {turn + 1}"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def report(tmp_path) -> tuple[Path, dict]:
    src = _recording(tmp_path / "rec.jsonl")
    out, js = tmp_path / "report.html", tmp_path / "report.json"
    for fmt, dest in (("html", out), ("json", js)):
        result = CliRunner().invoke(cli, ["analyze", str(src), "--format", fmt, "--out", str(dest),
                                          "--prefill-rate", "1000"])
        assert result.exit_code == 0, result.output
    return out, json.loads(js.read_text())


def _open(browser, path: Path, width: int = 1280):  # noqa: F811
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_function("document.body.dataset.rendered !== undefined")
    assert errors == []
    return page


def test_report_opens_on_the_cost_and_groups_one_fix_into_one_card(report, browser):  # noqa: F811
    path, d = report
    breaks = [t for s in d["sessions"] for t in s["turns"] if t["break"]]
    assert [t["index"] + 1 for t in breaks] == [4, 7, 10, 12]
    page = _open(browser, path)
    # The first thing in the page is the summary; its headline counts the breaks only, never the appends.
    assert page.evaluate("document.querySelector('main section').id") == "summary"
    headline = page.text_content("#headline")
    lost = sum(t["break"]["saves_tokens"] for t in breaks)
    assert f"4 cache breaks cost" in headline and f"{lost:,} re-prefilled tokens" in headline
    assert f"{d['totals']['reprefill_tokens']:,}" not in headline  # the old mixed number
    assert " s and " in headline  # seconds first
    # Per cause: seconds and tokens.
    rows = page.locator("#by-cause tbody tr")
    assert rows.count() == 2 and "system prompt rewritten" in rows.nth(0).text_content()
    # One card per cause + fix, listing its turns (not one card per turn).
    cards = page.locator("#fixes .group")
    assert cards.count() == 2
    volatile = page.locator('#fixes .group[data-cause="system_rewrite"]')
    assert volatile.locator(".turnlinks a").all_text_contents() == ["4", "7", "10"] or \
        sorted(volatile.locator(".turnlinks a").all_text_contents(), key=int) == ["4", "7", "10"]
    assert "Fix:" in volatile.locator("p.fix").text_content()
    assert "'" not in volatile.locator("p.fix").text_content()  # the card's fix is the same for all three…
    assert volatile.locator(".values").text_content() == "values seen: 0 → 1, 1 → 2, 2 → 3"  # …which differ here, in turn order
    # The differing characters are marked: the counter, not the whole window.
    first = volatile.locator("details.break").first
    assert first.locator("del").text_content() in ("0", "1", "2") and first.locator("ins").text_content() in ("1", "2", "3")
    page.screenshot(path=str(ARTIFACTS / "report_summary.png"))


def test_top_break_and_timeline_mark_open_the_detail(report, browser):  # noqa: F811
    path, _ = report
    page = _open(browser, path)
    # Every detail but the first of each card starts closed; a top-break link opens and shows it.
    target = page.locator("#top-breaks a").nth(2).get_attribute("href")[1:]
    assert page.evaluate(f"document.getElementById('{target}').open") is False
    page.locator("#top-breaks a").nth(2).click()
    page.wait_for_function(f"document.getElementById('{target}').open === true")
    assert page.locator(f"#{target} .diff pre.after").is_visible()
    # The timeline has axes, and each break is a mark that links to its detail.
    svg = page.locator("section.session svg.timeline")
    assert "prompt tokens" in svg.text_content() and "turn" in svg.text_content()
    marks = svg.locator("a.break-mark")
    assert marks.count() == 4
    page.evaluate("document.querySelectorAll('details.break').forEach((d) => { d.open = false; })")
    marks.nth(3).click()  # the tool added at turn 12
    page.wait_for_function("document.getElementById('b0-12').open === true")
    assert "tools_change" in page.locator("#b0-12 summary").text_content()
    page.locator("section.session").screenshot(path=str(ARTIFACTS / "report_timeline.png"))


def test_turn_table_sorts_and_filters(report, browser):  # noqa: F811
    path, _ = report
    page = _open(browser, path)
    assert page.locator("#turn-rows tr").count() == 13
    page.click('#turn-head th:has-text("lost tokens")')  # descending first: the costliest on top
    first = page.locator("#turn-rows tr").first
    assert first.get_attribute("class") == "brk"
    costs = [int(c.replace(",", "")) for c in page.locator("#turn-rows tr td:nth-child(10)").all_text_contents() if c]
    assert costs == sorted(costs, reverse=True) and len(costs) == 4
    page.click('#turn-head th:has-text("lost tokens")')  # again: ascending
    assert page.get_attribute('#turn-head th:has-text("lost tokens")', "aria-sort") == "ascending"
    page.select_option("#cause-filter", "breaks")
    assert page.locator("#turn-rows tr").count() == 4
    page.select_option("#cause-filter", "tools_change")
    assert page.locator("#turn-rows tr").count() == 1
    page.select_option("#cause-filter", "")
    page.fill("#filter", "first")
    assert page.locator("#turn-rows tr").count() == 1
    assert "of 1 (filtered from 13)" in page.text_content("#turn-count")
    page.fill("#filter", "")
    page.locator("#turn-rows a.to-break").first.click()  # from the table to the break's detail
    page.wait_for_function("[...document.querySelectorAll('details.break')].some((d) => d.open && "
                           "d.getBoundingClientRect().top >= 0 && d.getBoundingClientRect().top < innerHeight)")
    page.screenshot(path=str(ARTIFACTS / "report_table.png"), full_page=True)


def test_report_is_self_contained(report):
    path, _ = report
    text = path.read_text()
    assert "http" not in text.replace("http://www.w3.org/2000/svg", "")
    for fetch in ("<link", " src=", "@import", "url("):
        assert fetch not in text


def _synthetic(turns: int, sessions: int = 1, every: int = 50) -> dict:
    """A report dict of `turns` turns, a break every `every` turns (alternating causes)."""
    out = []
    per = turns // sessions
    for s in range(sessions):
        rows, size = [], 0
        for i in range(per):
            brk = None
            grown = 800 + (i % 7) * 40
            if i and i % every == 0:
                cause = ("system_rewrite", "tools_change", "history_edit")[(i // every) % 3]
                brk = {"cause": cause, "subtype": "volatile" if cause == "system_rewrite" else None,
                       "message_index": 0, "role": "system", "char_offset": 120, "token_offset": 30,
                       "before": f"Todo: {i - every} done. " + "a" * 180, "after": f"Todo: {i} done. " + "a" * 180,
                       "path": None, "tool_index": None, "tool_name": None, "suggestion": f"fix for {cause}",
                       "saves_tokens": size - 30}
            common = 30 if brk else size
            size = (size if not brk else size) + grown if size < 60_000 else 2_000
            rows.append({"index": i, "request_id": f"r{s}-{i}", "ts": 1_700_000_000 + i, "line": i,
                         "prompt_tokens": size, "common_prefix_tokens": min(common, size),
                         "reprefill_tokens": size - min(common, size), "reported_prompt_tokens": size,
                         "reported_cached_tokens": min(common, size), "note": "first" if i == 0 else "",
                         "break": brk, "ttft_s": 0.4 + (size - min(common, size)) / 2000})
        out.append({"id": f"session-{s}", "turns": rows})
    return {"renderer": "generic-chatml", "tokenizer": "tiktoken:o200k_base", "prefill_rate": None,
            "warnings": [], "sessions": out, "totals": {}}


def test_ten_thousand_turns_stay_usable(browser, tmp_path):  # noqa: F811
    """10,000 turns in one session: the page is a few MB, loads, and sorts and filters them all;
    side by side with a 100-turn report, it costs a bounded multiple, not 100 times as much."""
    timings = {}
    for n in (100, 10_000):
        path = tmp_path / f"r{n}.html"
        t = time.perf_counter()
        path.write_text(render(_synthetic(n)))
        build = time.perf_counter() - t
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        t = time.perf_counter()
        page.goto(path.as_uri())
        page.wait_for_function("document.body.dataset.rendered === '1'")
        load = time.perf_counter() - t
        t = time.perf_counter()
        page.click('#turn-head th:has-text("prompt tokens")')
        page.select_option("#cause-filter", "breaks")
        filtered = page.text_content("#turn-count")
        interact = time.perf_counter() - t
        assert page.locator("#turn-rows tr").count() == min(100, (n - 1) // 50)
        assert f"of {(n - 1) // 50:,} (filtered from {n:,})" in filtered
        timings[n] = (build, load, interact, path.stat().st_size)
        if n == 10_000:
            page.click("#top-breaks a")
            assert page.locator("details.break[open] ins").first.is_visible()
            page.screenshot(path=str(ARTIFACTS / "report_10k.png"))
    small, big = timings[100], timings[10_000]
    print(f"100 turns: build {small[0]:.2f} s, load {small[1]:.2f} s, sort+filter {small[2]:.2f} s, {small[3]:,} B; "
          f"10,000 turns: build {big[0]:.2f} s, load {big[1]:.2f} s, sort+filter {big[2]:.2f} s, {big[3]:,} B; "
          f"load ratio {big[1] / small[1]:.1f}x")
    assert big[3] < 8_000_000
    assert big[1] < 20 * small[1] + 5  # loose: a shared, loaded machine


def test_fields_of_the_shared_interface_are_shown_when_present(browser, tmp_path):  # noqa: F811
    """The analysis's agreed fields (1-based `number`, the one cost `lost_tokens`/`lost_seconds` and its
    basis, the char offset inside the message, the `diff` span, the volatile value, client and title,
    the renderer note) are what the page shows when the analysis carries them."""
    d = _synthetic(60, every=50)
    turn = d["sessions"][0]["turns"][50]
    turn.update(number=51, lost_tokens=1030, lost_seconds=42.5, lost_seconds_basis="ttft vs this session's cache hits")
    turn["break"].update(cause="system_rewrite", subtype="volatile", message_char_offset=53, volatile={"kind": "counter", "before": "0", "after": "50"},
                         diff={"before": "Todo: 0 done.", "after": "Todo: 50 done.", "start": 6, "before_end": 7,
                               "after_end": 8})
    d["sessions"][0].update(client="pi", title="fix the flaky test")
    d["renderer_note"] = "recorded: the served model's chat template"
    path = tmp_path / "r.html"
    path.write_text(render(d))
    page = _open(browser, path)
    assert "42.5 s" in page.text_content("#headline") and "1,030" in page.text_content("#headline")
    top = page.text_content("#top-breaks li")
    assert "turn 51 of pi · “fix the flaky test”" in top and "message 0 (system), char 53" in top
    detail = page.locator("details.break").first
    assert detail.locator("del").text_content() == "0" and detail.locator("ins").text_content() == "50"
    assert "seconds from ttft vs this session's cache hits" in detail.text_content()
    assert "volatile counter: 0 → 50" in detail.text_content()
    assert "recorded: the served model's chat template" in page.text_content("header")


def test_without_diff_spans_the_differing_characters_are_found_where_the_windows_agree_again(browser, tmp_path):  # noqa: F811
    """Before the analysis gives `diff` spans: the windows are cut at fixed lengths, so the span is
    where they agree again ("Mon|day" / "Tues|day"), not their common suffix, which means nothing."""
    d = _synthetic(60, every=50)
    brk = d["sessions"][0]["turns"][50]["break"]
    brk["before"] = "Today is Monday.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>"
    brk["after"] = "Today is Tuesday.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nr."
    path = tmp_path / "r.html"
    path.write_text(render(d))
    page = _open(browser, path)
    detail = page.locator("details.break[open]").first
    assert (detail.locator("del").text_content(), detail.locator("ins").text_content()) == ("Mon", "Tues")

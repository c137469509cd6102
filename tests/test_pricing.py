"""Dollars (issue 28, item 3): rates from genai-prices' maintained data, never a table written here.

The sheet applies the providers' tier rule in floats for speed; these tests hold it to the library's
own Decimal `calc_price`, at and past a tier's start, for a provider that charges cache writes
(Anthropic) and one that does not (OpenAI).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from genai_prices import Usage, calc_price

from analyzer import analyze
from analyzer.pricing import price_sheet
from prefixtrace.common.errors import InvalidRequest
from tests.conftest import ROOT

TRAFFIC = ROOT / "fixtures" / "traffic"


@pytest.mark.parametrize("model", ["claude-sonnet-4-5", "gpt-5", "claude-opus-4-1"])
@pytest.mark.parametrize("prompt,cached,written", [
    (1_000, 0, 0), (120_000, 100_000, 20_000), (200_000, 150_000, 50_000), (200_001, 150_000, 50_001),
    (480_000, 400_000, 0), (30_000, 0, 30_000),
])
def test_the_sheet_prices_a_prompt_as_the_library_does(model, prompt, cached, written):
    sheet = price_sheet(model)
    writes = written if sheet.charges_cache_writes else 0
    expected = calc_price(Usage(input_tokens=prompt, cache_read_tokens=cached, cache_write_tokens=writes),
                          model).input_price
    assert math.isclose(sheet.prompt_dollars(prompt, cached, written), float(expected), rel_tol=1e-9, abs_tol=1e-12)


def test_a_break_costs_the_write_rate_over_the_read_rate_where_writes_are_charged():
    anthropic, openai = price_sheet("claude-sonnet-4-5"), price_sheet("gpt-5")
    assert anthropic.charges_cache_writes and not openai.charges_cache_writes
    lost = 10_000
    assert math.isclose(anthropic.lost_dollars(lost, 50_000),
                        lost * (anthropic.cache_write.at(50_000) - anthropic.cache_read.at(50_000)))
    assert math.isclose(openai.lost_dollars(lost, 50_000), lost * (openai.input.at(50_000) - openai.cache_read.at(50_000)))
    assert anthropic.lost_dollars(lost, 50_000) > 0 and openai.lost_dollars(lost, 50_000) > 0


def test_an_unknown_model_is_a_clear_error():
    with pytest.raises(InvalidRequest, match="no price known for model 'no-such-model-zz'"):
        price_sheet("no-such-model-zz")


def test_what_if_prices_each_cache_in_dollars():
    report = analyze(TRAFFIC / "qwen_tiny.jsonl", what_if="anthropic,openai,vllm", price_model="gpt-5")
    sheet = price_sheet("gpt-5")
    prompts = [t.prompt_tokens for s in report.sessions for t in s.turns if t.prompt_tokens]
    no_cache = sum(sheet.prompt_dollars(p) for p in prompts)
    for w in report.what_if:
        d = w["dollars"]
        assert math.isclose(d["no_cache"], no_cache, rel_tol=1e-3)
        assert d["exact_prefix"] <= d["this_cache"] + 1e-9 <= d["no_cache"] + 1e-9
        assert "gpt-5" in w["priced_as"].lower() or "GPT-5" in w["priced_as"]
    # A cache that serves tokens saves dollars: the cheaper policy is the one that cached more.
    by_policy = {w["policy"]: w for w in report.what_if}
    assert (by_policy["openai"]["cached_tokens"] > by_policy["anthropic"]["cached_tokens"]) == \
        (by_policy["openai"]["dollars"]["this_cache"] < by_policy["anthropic"]["dollars"]["this_cache"])


def test_breaks_carry_dollars_and_the_cli_shows_the_rates(tmp_path):
    src = TRAFFIC / "qwen_tiny.jsonl"
    done = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "analyze", str(src), "--json", "--price-model",
                           "claude-sonnet-4-5"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    data = json.loads(done.stdout)
    assert data["pricing"]["model"] == "Claude Sonnet 4.5" and data["pricing"]["source"] == "genai-prices"
    breaks = [t for s in data["sessions"] for t in s["turns"] if t["break"]]
    assert breaks and all(t["lost_dollars"] and t["lost_dollars"] > 0 for t in breaks)
    text = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "analyze", str(src), "--price-model", "nope-model-q"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert text.returncode == 1 and text.stderr.count("Error:") == 1 and "nope-model-q" in text.stderr


"""`analyze()`: a recording in, a `Report` out. It picks the renderer and tokenizer,
walks the chains (analyzer/chains.py), prices the breaks (analyzer/costing.py) and,
when asked, the what-if caches and dollars. The result model is analyzer/results.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from analyzer.chains import Analyzer
from analyzer.costing import dollars_of_breaks
from analyzer.hashed import blind
from analyzer.load import load
from analyzer.merged_sessions import mark_merged
from analyzer.render import make_renderer
from analyzer.results import Report
from analyzer.server_counts import PARTIAL_LOSS_MIN
from analyzer.tokens import Tokenizer
from analyzer.write_waste import write_waste
from prefixtrace.common.errors import InvalidRequest



def analyze(source: str | Path | Iterable[Any], *, template: str | Path | None = None, model: str | Path | None = None,
            tokenizer: Tokenizer | str | None = None, block_size: int | None = None,
            prefill_rate: float | None = None, renderer=None, workers: int | None = None,
            what_if: list[str] | str | None = None, kv_budget: int | None = None,
            price_model: str | None = None, price_provider: str | None = None,
            min_partial_loss: int = PARTIAL_LOSS_MIN, propose_fixes: bool = True) -> Report:
    """Analyses a recorder database, a JSONL file, or an iterable of request
    bodies / Requests / recorder Turns.

    Args:
        template: a chat template file (.jinja).
        model: a model directory: its tokenizer_config.json chat template and,
            unless `tokenizer` is given, its tokenizer.json.
        tokenizer: a Tokenizer or spec ("regex", "tiktoken:NAME", a
            tokenizer.json path); default tiktoken o200k_base (offline copy).
        block_size: also report the block-aligned figures of a paged cache.
        prefill_rate: tokens per second, to price re-prefill in seconds.
        workers: processes for the per-session work (default: up to 2).
        what_if: also price the traffic under these caches ("vllm", "sglang", "anthropic", "openai";
            analyzer/whatif.py), with `block_size` as their block/page size and `kv_budget` tokens of KV.
        price_model: price in dollars as this model ("claude-sonnet-4-5", "gpt-5"; genai-prices'
            data, analyzer/pricing.py): each break's lost tokens and each what-if policy.
        price_provider: the provider whose price of `price_model` to use (default: genai-prices' match).
        min_partial_loss: a server-side loss of this many tokens or more, by the server's own counts, is
            a `server_miss` whatever its share of the prompt (analyzer/server_counts.py).
        propose_fixes: for each cause found, apply the fix that addresses it and analyse again
            (analyzer/fix_report.py): what it would have saved.
    """
    given = renderer is not None or template is not None or model is not None
    renderer = renderer or make_renderer(template, model)
    if tokenizer is None and model is not None and (Path(model) / "tokenizer.json").is_file():
        tokenizer = str(Path(model) / "tokenizer.json")
    from analyzer.whatif import parse_policies, what_if as price_all

    policies = parse_policies(what_if) if isinstance(what_if, str) or what_if is None else parse_policies(",".join(what_if))
    if kv_budget is not None and kv_budget <= 0:
        raise InvalidRequest("--kv-budget must be positive")
    sheet = None
    if price_model:
        from analyzer.pricing import price_sheet

        sheet = price_sheet(price_model, price_provider)
    loaded = load(source)
    from analyzer.server_renderer import choose_renderer

    choice = choose_renderer(loaded, renderer if given else None, tokenizer)
    analyzer = Analyzer(choice.renderer, choice.tokenizer, block_size=block_size, prefill_rate=prefill_rate,
                        workers=workers, min_partial_loss=min_partial_loss)
    analyzer.exact_counts = choice.exact
    report = analyzer.run(loaded.requests, loaded.skipped)
    report.renderer_source, report.renderer_note = choice.source, choice.note
    report.replayed = loaded.replayed
    report.remote_compactions = loaded.remote_compactions
    mark_merged(report)
    if policies:
        report.what_if = price_all(report, policies, block_size=block_size, kv_budget=kv_budget, sheet=sheet)
    if sheet is not None:
        report.pricing = sheet.to_dict()
        dollars_of_breaks(report, sheet)
    report.write_waste = write_waste(report, {r.id: r for r in loaded.requests}, sheet)
    blind(report, {r.id for r in loaded.requests if r.hashed})
    _fixes(report, loaded.requests, analyzer, sheet, propose_fixes)
    return report


def _fixes(report: Report, requests: list, analyzer: Analyzer, sheet, propose: bool) -> None:
    """The fixes the proxy applied, and (`propose`) each addressing fix measured by re-analysis."""
    from analyzer.fix_report import propose_fixes, proxy_fix_summary, renders_earlier_reasoning

    def reanalyse(fixed: list) -> Report:
        again = analyzer.run(fixed, [])
        if sheet is not None:
            dollars_of_breaks(again, sheet)
        return again

    report.proxy_fixes = proxy_fix_summary(requests)
    if propose:
        report.fix_proposals = propose_fixes(report, requests, reanalyse,
                                             renders_earlier_reasoning(analyzer.renderer))


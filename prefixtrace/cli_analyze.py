"""`prefixtrace analyze` and `prefixtrace check`: thin shells over `analyzer`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from prefixtrace.common.words import plural
from prefixtrace.cli_common import FiniteFloatRange, echo, library_errors, output_path, progress, write_or_echo

# analyzer.server_counts.PARTIAL_LOSS_MIN, spelled here so the CLI starts without importing the analyzer
# (tests/test_server_counts.py checks they agree).
PARTIAL_LOSS_MIN = 5000
SRC = click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))


def _render_options(fn):
    for option in reversed([
        click.option("--template", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="Render with this chat template (.jinja), as the server would."),
        click.option("--model", type=click.Path(exists=True, file_okay=False, path_type=Path),
                     help="Render with this model directory's chat template and count with its tokenizer.json."),
        click.option("--tokenizer", "tokenizer_spec", metavar="SPEC",
                     help="'regex', 'tiktoken:NAME' or a tokenizer.json path (default: the model's, else tiktoken o200k_base)."),
        click.option("--block-size", type=int, help="Also report block-aligned figures for a paged cache of N-token blocks."),
        click.option("--prefill-rate", type=FiniteFloatRange(), metavar="TOK_PER_S",
                     help="Price lost tokens at this rate instead of the recorded timings (TTFT against the "
                          "session's cache hits, else a prefill rate measured from its turns)."),
        click.option("--min-partial-loss", type=click.IntRange(min=0), default=PARTIAL_LOSS_MIN, show_default=True,
                     metavar="TOKENS",
                     help="Report a server-side loss of this many tokens or more (by the server's own counts) "
                          "as a server_miss, whatever its share of the prompt."),
    ]):
        fn = option(fn)
    return fn


JSON_FORMAT = click.option("--json", "as_json", is_flag=True, help="Same as --format json.")
MAX_UNREADABLE = click.option(
    "--max-unreadable", default="0", show_default=True, metavar="N|P%",
    help="Exit 1 when more than this many (or this share) of the requests could not be read or rendered.")


def _kwargs(template, model, tokenizer_spec, block_size, prefill_rate, min_partial_loss=PARTIAL_LOSS_MIN) -> dict:
    return dict(template=template, model=model, tokenizer=tokenizer_spec, block_size=block_size,
                prefill_rate=prefill_rate, min_partial_loss=min_partial_loss)


@click.command()
@SRC
@_render_options
@click.option("--format", "fmt", type=click.Choice(["text", "json", "html", "markdown"]), default="text",
              show_default=True, help="markdown: for pasting into an issue (docs/ANALYZER.md).")
@JSON_FORMAT
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), callback=output_path,
              help="Write the report here instead of stdout.")
@MAX_UNREADABLE
@click.option("--what-if", "what_if", metavar="CACHES",
              help="Also price the traffic under other caches' documented rules, comma-separated: "
                   "vllm, sglang, anthropic, openai (docs/ANALYZER.md 'What if').")
@click.option("--kv-budget", type=click.IntRange(min=1), metavar="TOKENS",
              help="With --what-if vllm/sglang: the server's KV cache size in tokens (LRU eviction beyond it).")
@click.option("--price-model", metavar="MODEL",
              help="Also price in dollars as this hosted model (e.g. claude-sonnet-4-5, gpt-5): each break's lost "
                   "tokens and, with --what-if, each cache; rates from the genai-prices package (docs/ANALYZER.md).")
@click.option("--price-provider", metavar="PROVIDER",
              help="With --price-model: whose price of that model (e.g. anthropic, openai, aws, google).")
@click.option("--otlp-endpoint", metavar="URL",
              help="Also export one OpenTelemetry span per turn (its recorded time, GenAI attributes, the break's "
                   "cause, cost and fix) over OTLP/HTTP to this collector, e.g. http://127.0.0.1:4318; needs "
                   "pip install 'prefixtrace[otel]' (docs/OBSERVABILITY.md).")
@click.option("--no-fix-proposals", is_flag=True,
              help="Skip measuring, for each cause found, what its fix would have saved (a second analysis of the "
                   "sessions concerned, docs/FIXES.md).")
@library_errors
def analyze(src, template, model, tokenizer_spec, block_size, prefill_rate, min_partial_loss, fmt, as_json, out,
            max_unreadable, what_if, kv_budget, price_model, price_provider, otlp_endpoint, no_fix_proposals):
    """Per session and turn: did the prompt extend the previous one; if not, what
    it cost (seconds from the recorded timings, then tokens; dollars with --price-model),
    where it broke (message, char inside it, token offset, the differing characters
    marked) and why (a fixed cause name), with the fix.

    SRC is a recorder database, a JSONL file (wrapped records or bare request
    bodies, see docs/FORMATS.md), or a Claude Code, Codex or pi session file or
    opencode's database (rebuilt as `import` does, each session saying what its
    transcript does not hold); sessions without ids are inferred. Malformed
    lines are reported with their line number and skipped.

    Example: prefixtrace analyze prefixtrace.db --template qwen3.jinja --format html --out report.html
    """
    from analyzer import analyze as run_analyze, format_text, to_json
    from analyzer.html import to_html
    from analyzer.markdown import to_markdown

    if otlp_endpoint:  # a missing extra or a bad URL: one line before any work
        from prefixtrace.otel import require_sdk, traces_url

        traces_url(otlp_endpoint)
        require_sdk()
    with progress(f"analyzing {src.name}"):
        report = run_analyze(src, what_if=what_if, kv_budget=kv_budget, price_model=price_model,
                             price_provider=price_provider, propose_fixes=not no_fix_proposals,
                             **_kwargs(template, model, tokenizer_spec, block_size, prefill_rate, min_partial_loss))
    too_much = report.too_much_unread(max_unreadable)
    text = {"text": format_text, "json": to_json, "html": to_html, "markdown": to_markdown}["json" if as_json else fmt](report)
    write_or_echo(text, out)
    if otlp_endpoint:
        _export_spans(src, report, otlp_endpoint)
    if too_much:  # never a silent zero: the report above says what was not analysed, and so does the exit code
        if out is not None or as_json or fmt != "text":  # else the text on the terminal already says it, once
            click.echo("; ".join(report.warnings()) or "part of the input could not be analysed", err=True)
        raise SystemExit(1)


def _export_spans(src: Path, report, endpoint: str) -> None:
    from prefixtrace.common.errors import InvalidRequest, RecorderError
    from prefixtrace.otel import TurnSpans, export_report
    from prefixtrace.common.urls import display_url
    from recorder.sources import load_turns

    try:
        turns = load_turns(src)
    except (InvalidRequest, RecorderError, ValueError):  # bare request bodies: spans from the analysis alone
        turns = []
    spans = TurnSpans.open(endpoint)
    with progress(f"exporting spans to {display_url(spans.url)}"):
        count = export_report(report, turns, spans)
        spans.close(timeout_s=30.0)
    exporter = spans.exporter
    if exporter.failed or exporter.exported < count:
        raise click.ClickException(f"{exporter.failed or count - exporter.exported} of {plural(count, 'span')} could not be "
                                   f"exported to {display_url(spans.url)} (is an OTLP/HTTP collector listening there?)")
    click.echo(f"exported {plural(count, 'span')} to {display_url(spans.url)}", err=True)


@click.command()
@SRC
@click.option("--allow", default="", metavar="CAUSES", help="Comma-separated causes that do not fail, e.g. compaction,request_local_tail.")
@click.option("--fail-on", "fail_on", default="", metavar="KINDS",
              help="Also fail on these, comma-separated: side_request (a fork of the main chain, e.g. title generation), "
                   "server_miss (the prompt only grew but the server cached less of it).")
@_render_options
@click.option("--junit", type=click.Path(dir_okay=False, path_type=Path), callback=output_path, help="Also write a JUnit XML report here.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@JSON_FORMAT
@MAX_UNREADABLE
@library_errors
def check(src, allow, fail_on, template, model, tokenizer_spec, block_size, prefill_rate, min_partial_loss, junit,
          fmt, as_json, max_unreadable):
    """Exit 0 when every transition of every session is append-only or of an
    allowed cause, else 1, naming the first offending turn, its cause, what it
    cost (seconds, tokens), where and its diff.

    Meant for CI: record (or script) a harness session, then assert that its
    prompts only ever grow at the end, so the server's prefix cache keeps working.

    Example: prefixtrace check recorded-session.jsonl --allow compaction,request_local_tail --junit prefix.xml
    """
    from analyzer import check as run_check, to_junit

    with progress(f"checking {src.name}"):
        result = run_check(src, allow=allow, fail_on=fail_on, max_unreadable=max_unreadable, **_kwargs(template, model, tokenizer_spec, block_size, prefill_rate, min_partial_loss))
    if junit:
        to_junit(result, junit)
    if fmt == "json" or as_json:
        click.echo(json.dumps({"ok": result.ok, "allow": sorted(result.allow),
                               "renderer_source": result.report.renderer_source,
                               "renderer_note": result.report.renderer_note,
                               "warnings": result.report.warnings(), "coverage": result.report.coverage(), "problems": [
            {"session": p.session_id, "turn_number": p.turn.number, "lost_seconds": p.turn.lost_seconds,
             "lost_tokens": p.turn.lost_tokens, "lost_seconds_basis": p.turn.lost_seconds_basis,
             "turn": p.turn.to_dict()} for p in result.problems]}, indent=2))
    else:
        echo(result.summary())
        for problem in result.problems[1:]:
            echo(f"- {problem}")
        if result.report.renderer_source == "fallback":  # offsets and tokens are estimates: say so, and the fix
            echo(f"note: {result.report.renderer_note}")
    raise SystemExit(0 if result.ok else 1)

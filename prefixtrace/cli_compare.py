"""`prefixtrace compare`: a thin shell over analyzer/compare.py."""

from __future__ import annotations

from pathlib import Path

import click

from prefixtrace.cli_analyze import _kwargs, _render_options
from prefixtrace.cli_common import FiniteFloatRange, library_errors, output_path, progress, write_or_echo

SOURCE = click.Path(exists=True, dir_okay=False, path_type=Path)


@click.command()
@click.argument("a", type=SOURCE)
@click.argument("b", type=SOURCE, required=False)
@click.option("--by", type=click.Choice(["version", "harness", "model"]),
              help="Compare one source's turns grouped by the harness's version, the harness or the model.")
@_render_options
@click.option("--max-regression", type=FiniteFloatRange(min=0), metavar="POINTS",
              help="Exit 1 when a miss rate (overall, per cause, per turn kind) rose by more than this many "
                   "percentage points from one side to the next: a CI gate.")
@click.option("--price-model", metavar="MODEL", help="Also price the lost tokens in dollars as this hosted model.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown", "html"]), default="text",
              show_default=True, help="markdown: for a pull-request comment.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), callback=output_path,
              help="Write the comparison here instead of stdout.")
@library_errors
def compare(a, b, by, template, model, tokenizer_spec, block_size, prefill_rate, min_partial_loss, max_regression,
            price_model, fmt, out):
    """Hit rate, misses per cause and per what opened the turn, seconds and dollars lost: two
    recordings (or transcripts) side by side, or one grouped with --by, with the deltas. With
    --max-regression, exits 1 when a miss rate rose past it (docs/ANALYZER.md "Comparing recordings").

    Example: prefixtrace compare before.db after.db --max-regression 5 --format markdown
    """
    from analyzer import analyze
    from analyzer.compare import FORMATS, comparison, group, sides_of

    if (b is None) == (by is None):
        raise click.UsageError("give two sources (A B), or one with --by version|harness|model")
    kwargs = dict(price_model=price_model,
                  **_kwargs(template, model, tokenizer_spec, block_size, prefill_rate, min_partial_loss))
    with progress(f"analyzing {a.name}"):
        first = analyze(a, **kwargs)
    if by is not None:
        sides = group(first, by)
    else:
        with progress(f"analyzing {b.name}"):
            second = analyze(b, **kwargs)
        sides = sides_of([(a.name, first), (b.name if b.name != a.name else str(b), second)])
    result = comparison(sides, max_regression)
    write_or_echo(FORMATS[fmt](result), out)
    if result["regressions"]:
        if out is not None or fmt != "text":
            click.echo("; ".join(f"{r['what']} rose {r['rise_points']:+.1f} points" for r in result["regressions"]),
                       err=True)
        raise SystemExit(1)

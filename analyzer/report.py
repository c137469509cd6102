"""Report forms: JSON (the stable schema of docs/ANALYZER.md) and text (rich tables)."""

from __future__ import annotations

import io
import json

from analyzer.analysis import Report


def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, ensure_ascii=False)


def _q(value) -> str:
    return "?" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f" ≈ {seconds / 60:.1f} min" if seconds >= 60 else f" ≈ {seconds:.0f} s"


def _provider_cache(t) -> str:
    """The provider's own cache figures of a turn, when it reported them (docs/ANALYZER.md)."""
    parts = [f"{name} {value:,}" for name, value in (("cache read", t.reported_cache_read_tokens),
                                                      ("cache write", t.reported_cache_write_tokens)) if value is not None]
    if t.server_miss_reason:
        parts.append(f"provider's miss reason {t.server_miss_reason}")
    return f" ({', '.join(parts)})" if parts else ""


def format_text(report: Report, width: int = 140) -> str:
    """A table per session (rich), a window under each break, totals per cause."""
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    # markup=False: session ids and roles are client text, not rich markup ("[/x]" would raise).
    console = Console(file=buf, width=width, no_color=True, highlight=False, soft_wrap=False, markup=False)
    for warning in report.warnings():
        console.print(f"WARNING: {warning}")
    console.print(f"renderer: {report.renderer}    tokenizer: {report.tokenizer}"
                  + (f"    block size: {report.block_size}" if report.block_size else "")
                  + (f"    prefill rate: {report.prefill_rate:g} tok/s" if report.prefill_rate else ""))
    if report.renderer_note:
        console.print(f"({report.renderer_note})")
    elif report.renderer == "generic-chatml":
        console.print("(no chat template given: generic ChatML-like renderer, see docs/ANALYZER.md)")
    for skipped in report.skipped:
        console.print(f"skipped line {skipped['line']}: {skipped['error']}", markup=False)
    if report.failed:
        console.print(f"{len(report.failed)} failed request(s) (listed, not chained):", markup=False)
        for f in report.failed:
            console.print(f"  line {f['line']} status {f['status']} session {f['session']}: {f['error'][:120]}",
                          markup=False)
    for s in report.sessions:
        d = s.to_dict(report.prefill_rate)
        breaks = [t for t in s.turns if t.brk]
        kind = f"side request of {s.parent}, {s.side_reason}; " if s.parent else ""
        table = Table(title=f"session {s.id} ({kind}{'inferred' if s.inferred else 'explicit'}): {len(s.turns)} turns, "
                            f"{len(breaks)} break(s)", title_justify="left")
        for col in ("#", "prompt", "common", "reprefill", "cached (reported)", "break"):
            table.add_column(col, justify="right" if col != "break" else "left")
        for t in s.turns:
            if t.brk:
                where = f"{t.brk.cause}{'/' + t.brk.subtype if t.brk.subtype else ''} @ {t.brk.where()}" \
                        f", char {t.brk.char_offset:,}, token {t.brk.token_offset:,}"
            else:
                where = t.note or "append-only"
            flag = " !" if t.cached_disagrees else ""
            table.add_row(str(t.index), _q(t.prompt_tokens), _q(t.common_prefix_tokens), _q(t.reprefill_tokens),
                          f"{_q(t.reported_cached_tokens)}{flag}", where)
        console.print(table)
        for t in breaks:
            if t.brk.cause == "server_miss":  # nothing differs in the prompt: say what the server did
                console.print(f"  turn {t.index} server_miss/{t.brk.subtype}: the server cached "
                              f"{_q(t.reported_cached_tokens)} of the {_q(t.predicted_cached_tokens)} predicted: "
                              f"{t.brk.detail}" + _provider_cache(t))
                console.print(f"    fix: {t.brk.suggestion}")
                continue
            console.print(f"  turn {t.index} {t.brk.cause}: first difference at char {t.brk.char_offset:,}"
                          + (f", payload {t.brk.path}" if t.brk.path else ""))
            console.print(f"    - {t.brk.before!r}")
            console.print(f"    + {t.brk.after!r}")
            if t.brk.suggestion:
                console.print(f"    fix (saves {t.brk.saves_tokens:,} tokens): {t.brk.suggestion}")
        for cause, c in d["totals"]["by_cause"].items():
            console.print(f"  {cause}: {c['breaks']} break(s), {c['reprefill_tokens']:,} tokens re-prefilled"
                          + _minutes(c.get("seconds")))
        console.print("")
    totals = report.to_dict()["totals"]
    console.print(f"overall: {totals['reprefill_tokens']:,} of {totals['prompt_tokens']:,} prompt tokens re-prefilled"
                  + _minutes(totals["reprefill_seconds"]))
    for cause, c in totals["by_cause"].items():
        console.print(f"  {cause} cost {c['reprefill_tokens']:,} tokens{_minutes(c.get('seconds'))} "
                      f"over {c['breaks']} break(s)")
    for w in report.what_if:
        console.print(f"what if {w['policy']} ({w['rules']}): {w['cached_tokens']:,} of {w['prompt_tokens']:,} "
                      f"prompt tokens cached ({(w['hit_rate'] or 0) * 100:.1f} %), {w['reprefill_tokens']:,} re-prefilled; "
                      f"exact-prefix ideal {w['ideal_cached_tokens']:,}"
                      + "".join(f"; lost to {k} {v:,}" for k, v in w["lost_to"].items()))
    console.print("('!' = the server's reported cached tokens disagree with the prediction by more than 10 points)")
    return buf.getvalue()

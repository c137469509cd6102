"""Report forms: JSON (the stable schema of docs/ANALYZER.md) and text (rich tables)."""

from __future__ import annotations

import io
import json

from analyzer import report_view as rv
from analyzer.results import Report
from analyzer.turn_kinds import miss_rates
from analyzer.turn_kinds import text_line as kinds_line
from analyzer.write_waste import text_lines as waste_lines
from analyzer.fix_report import fix_lines as proxy_fix_lines
from analyzer.server_counts import TOKEN_BASES, cached_text
from prefixtrace.common.words import plural
from recorder.redact import DEFAULT_REDACTOR


def to_json(report: Report) -> str:
    return json.dumps(report.to_dict(), indent=2, ensure_ascii=False)


def _q(value) -> str:
    return "?" if value is None else f"{value:,}" if isinstance(value, int) else str(value)


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f" ≈ {seconds / 60:.1f} min" if seconds >= 60 else f" ≈ {seconds:.0f} s"


def _usd(value: float) -> str:
    return f"${value:,.2f}" if value >= 1 else f"${value:.4f}"


def seconds_text(seconds: float | None) -> str:
    """"49.3 s", "2.1 min", "?" (not priced)."""
    if seconds is None:
        return "? s"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"


def cost_text(seconds: float | None, tokens: int | None) -> str:
    """The one cost of a break (or a sum of them), seconds first: "1.63 s, 700 tokens"; "700 tokens (no
    timings)" when it could not be priced in seconds."""
    counted = plural(tokens, "token") if isinstance(tokens, int) else f"{_q(tokens)} tokens"
    if seconds is None:
        return f"{counted} (no timings)"
    return f"{seconds_text(seconds)}, {counted}"


def _escape(text: str) -> str:
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\\":
            out.append("\\\\")
        elif ord(ch) < 32 or 0x7F <= ord(ch) < 0xA0:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def _plain(line: str) -> str:
    """A line of client text (ids, roles, tool names, notes) written past rich: what a terminal would act
    on shown as `\\uXXXX` (prefixtrace/common/escaping.py, as the CLI's own output), so a hostile id cannot move
    the cursor or colour the terminal."""
    from prefixtrace.common.escaping import visible

    return visible(line)


def _clip(text: str, limit: int, left: bool) -> str:
    text = DEFAULT_REDACTOR.text(text)  # before the cut: a cut secret matches no pattern
    if len(text) <= limit:
        return text
    return "…" + text[len(text) - limit + 1:] if left else text[: limit - 1] + "…"


def caret_lines(diff: dict, indent: str = "    ", left: int = 50, middle: int = 120, right: int = 40) -> list[str]:
    """The two sides of a break, escaped on one line each, with a caret line under the characters that
    differ (an empty span, an insertion on the other side, gets one caret where it goes)."""
    lines = []
    for sign, text, end in (("-", diff["before"], diff["before_end"]), ("+", diff["after"], diff["after_end"])):
        start = diff["start"]
        head = _clip(_escape(text[:start]), left, left=True)
        mid = _clip(_escape(text[start:end]), middle, left=False)
        tail = _clip(_escape(text[end:]), right, left=False)
        lines.append(f"{indent}{sign} {head}{mid}{tail}")
        lines.append(f"{indent}  {' ' * len(head)}{'^' * max(1, len(mid))}")
    return lines


def _provider_cache(t) -> str:
    """The provider's own cache figures of a turn, when it reported them (docs/ANALYZER.md)."""
    parts = [f"{name} {value:,}" for name, value in (("cache read", t.reported_cache_read_tokens),
                                                      ("cache write", t.reported_cache_write_tokens)) if value is not None]
    if t.server_miss_reason:
        parts.append(f"provider's miss reason {t.server_miss_reason}")
    return f" ({', '.join(parts)})" if parts else ""


def format_text(report: Report, width: int = 140) -> str:
    """Seconds first: a table per session, each break with its cost, where it is (message, char inside
    the message, a caret line under the characters that differ) and its fix, then totals per cause and
    the costliest breaks."""
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    # markup=False: session ids and roles are client text, not rich markup ("[/x]" would raise).
    console = Console(file=buf, width=width, no_color=True, highlight=False, soft_wrap=False, markup=False)
    for warning in report.warnings():
        console.print(f"WARNING: {warning}")
    if not report.coverage()["analysed"] and not report.failed:
        return buf.getvalue() + _nothing_read(report)
    # The answer first, as the Markdown and HTML reports open: what to fix, one line per cause and fix,
    # costliest first; the session tables below run for screens on a long recording and refer to it.
    fixes = fix_lines(report)
    for line in fixes:  # values a volatile break took are client text: redacted as the diffs are
        buf.write(_plain(DEFAULT_REDACTOR.text(line)) + "\n")
    said = {g["fix"]: i for i, g in enumerate(_fix_groups(report), 1) if g["fix"]}
    console.print(f"renderer: {report.renderer}    tokenizer: {report.tokenizer}"
                  + (f"    block size: {report.block_size}" if report.block_size else "")
                  + (f"    prefill rate: {report.prefill_rate:g} tok/s" if report.prefill_rate else ""))
    if report.renderer_note:
        console.print(f"({report.renderer_note})")
    elif report.renderer == "generic-chatml":
        console.print("(no chat template given: generic ChatML-like renderer, see docs/ANALYZER.md)")
    for line in proxy_fix_lines(report):  # fixed by the proxy; fixes proposed (analyzer/fix_report.py)
        console.print(line)
    for skipped in report.skipped:
        console.print(f"skipped line {skipped['line']}: {skipped['error']}", markup=False)
    if report.failed:
        console.print(f"{plural(len(report.failed), 'failed request')} (listed, not chained):", markup=False)
        for f in report.failed:
            console.print(f"  line {f['line']} status {f['status']} session {f['session']}: {f['error'][:120]}",
                          markup=False)
    for s in report.sessions:
        d = s.to_dict(report.prefill_rate)
        breaks = [t for t in s.turns if t.brk]
        kind = f"side request of {s.parent}, {s.side_reason}; " if s.parent else ""
        st = d["totals"]
        cost = f", costing {cost_text(st['lost_seconds'], st['lost_tokens'])}" if breaks else ""
        # The title on its own line: as a table title, rich wraps it to the table's width.
        buf.write(_plain(f"session {s.id} ({kind}{'inferred' if s.inferred else 'explicit'}): "
                         f"{plural(len(s.turns), 'turn')}, {plural(len(breaks), 'break')}{cost}") + "\n")
        if s.transcript:
            version = f" {s.transcript['version']}" if s.transcript.get("version") else ""  # the file's format version
            buf.write(_plain(f"  rebuilt from a transcript of {s.transcript.get('harness')}{version} ({s.transcript.get('file')}); "
                             f"not rebuilt: {'; '.join(s.transcript.get('not_rebuilt') or []) or 'nothing'}") + "\n")
        table = Table()
        for col in ("turn", "prompt", "predicted cached", "server prompt", "server cached", "TTFT", "lost",
                    "what happened"):
            table.add_column(col, justify="left" if col == "what happened" else "right")
        for t in s.turns:
            if t.brk:
                what = f"{t.brk.cause}{'/' + t.brk.subtype if t.brk.subtype else ''} at {t.brk.location()}"
                lost = cost_text(t.lost_seconds, t.lost_tokens)
            else:
                what, lost = t.note or "append-only", ""
                if what.startswith("side request of"):
                    what = what.split(" because ")[0].split(": ", 1)[-1] + " (side request: see below)"
            flag = " !" if t.cached_disagrees else ""
            table.add_row(str(t.number), _q(t.prompt_tokens), _q(t.predicted_cached_tokens),
                          _q(t.reported_prompt_tokens), f"{_q(t.reported_cached_tokens)}{flag}",
                          "" if t.ttft_s is None else seconds_text(t.ttft_s), lost, what)
        console.print(table)
        for t in s.turns:
            if t.brk is None and t.note.startswith("side request of"):
                buf.write(_plain(f"  turn {t.number}: {t.note}") + "\n")
        for t in breaks:
            if t.brk.cause == "server_miss":  # nothing differs in the prompt: say what the server did
                console.print(f"  turn {t.number} server_miss/{t.brk.subtype}: lost "
                              f"{cost_text(t.lost_seconds, t.lost_tokens)}: {cached_text(t)}: "
                              f"{t.brk.detail}" + _provider_cache(t))
                if t.lost_tokens_basis in TOKEN_BASES:
                    console.print(f"    tokens: {TOKEN_BASES[t.lost_tokens_basis]}")
                console.print(f"    fix: {_fix_ref(t.brk.suggestion, said)}")
                continue
            _print_break(buf, console, t, said)
        for cause, c in st["by_cause"].items():
            console.print(f"  {cause}: {plural(c['breaks'], 'break')} cost {cost_text(c['lost_seconds'], c['lost_tokens'])}")
        console.print("")
    totals = report.to_dict()["totals"]
    if totals["breaks"]:
        unpriced = totals["breaks"] - totals["priced"]
        console.print(f"overall: {plural(totals['breaks'], 'break')} cost {cost_text(totals['lost_seconds'], totals['lost_tokens'])}"
                      + (f" ({unpriced} not priced in seconds: no timings recorded; give --prefill-rate)"
                         if unpriced else ""))
        for cause, c in totals["by_cause"].items():
            console.print(f"  {cause} cost {cost_text(c['lost_seconds'], c['lost_tokens'])} over {plural(c['breaks'], 'break')}")
        top = report.top_breaks(5)
        if len(report.breaks) > 1:
            console.print("costliest breaks:")
            for s, t in top:
                console.print(f"  {cost_text(t.lost_seconds, t.lost_tokens)}: session {s.id} turn {t.number}, "
                              f"{t.brk.cause}{'/' + t.brk.subtype if t.brk.subtype else ''} at {t.brk.location()}")
    elif report.coverage()["analysed"]:
        console.print("overall: no break: every turn extended its session's previous prompt")
    else:  # the warning above said why; "no break" would claim a result there is none of
        console.print("overall: nothing analysed, so nothing to say about breaks")
    console.print(f"prompt tokens: {totals['prompt_tokens']:,}, of which {totals['reprefill_tokens']:,} not served by "
                  f"the prefix cache (new turns' own tokens included)" + _minutes(totals["reprefill_seconds"]))
    if totals["server_counted_turns"]:
        console.print(f"by the server's own counts: {totals['server_prompt_tokens']:,} prompt tokens over "
                      f"{totals['server_counted_turns']:,} turn(s), {totals['server_cached_tokens']:,} of them read "
                      f"from cache")
    for w in report.what_if:
        console.print(f"what if {w['policy']} ({w['rules']}): {w['cached_tokens']:,} of {w['prompt_tokens']:,} "
                      f"prompt tokens cached ({(w['hit_rate'] or 0) * 100:.1f} %), {w['reprefill_tokens']:,} re-prefilled; "
                      f"exact-prefix ideal {w['ideal_cached_tokens']:,}"
                      + "".join(f"; lost to {k} {v:,}" for k, v in w["lost_to"].items()))
        if "dollars" in w:
            d = w["dollars"]
            console.print(f"  in dollars: {_usd(d['this_cache'])} with this cache, {_usd(d['no_cache'])} with none, "
                          f"{_usd(d['exact_prefix'])} if every shared prefix were served")
    if report.pricing:
        console.print(f"priced as {report.pricing['model']} ({report.pricing['provider']}): "
                      f"${report.pricing['input_per_mtok']:g}/M input, ${report.pricing['cache_read_per_mtok']:g}/M "
                      "cache read" + (f", ${report.pricing['cache_write_per_mtok']:g}/M cache write"
                                      if report.pricing.get("cache_write_per_mtok") is not None else "")
                      + " (genai-prices)")
        lost = sum(t.lost_dollars or 0 for s in report.sessions for t in s.turns)
        console.print(f"breaks cost {_usd(lost)} over reading those tokens from the cache")
    for line in waste_lines(report.write_waste):
        console.print(line)
    kinds = kinds_line(miss_rates(t for s in report.sessions for t in s.turns))
    if kinds:
        console.print(kinds)
    console.print("(lost = what a cache would have served had the request only extended the previous one, in seconds "
                  "from the recorded timings, then tokens: docs/ANALYZER.md \"Cost\"; "
                  "'!' = the server's cached tokens disagree with the prediction by more than 10 points)")
    return buf.getvalue()


def _nothing_read(report: Report) -> str:
    """The one thing to say when no request could be read (a text file, an empty one): the first reasons
    and what the input should be; no renderer, totals or "no break" that would claim a result."""
    lines = [_plain(f"skipped line {s['line']}: {s['error']}") for s in report.skipped[:3]]
    if len(report.skipped) > 3:
        lines.append(f"… and {plural(len(report.skipped) - 3, 'more line')} like these")
    lines.append("not analysed: give a recorder database, a JSONL or HAR file (docs/FORMATS.md) or a harness "
                 "session file")
    return "\n".join(lines) + "\n"


def break_lines(t, indent: str = "  ", said: dict[str, int] | None = None) -> list[str]:
    """One break as a person reads it: cost (seconds first) and how it was priced, where (message, char
    inside it, token of the prompt), the two sides with a caret line, the fix."""
    b = t.brk
    name = f"{b.cause}{'/' + b.subtype if b.subtype else ''}"
    dollars = f", {_usd(t.lost_dollars)}" if getattr(t, "lost_dollars", None) else ""
    lines = [f"{indent}turn {t.number}: {name} at {b.location()}: lost {cost_text(t.lost_seconds, t.lost_tokens)}{dollars}"]
    if t.lost_seconds_basis and t.lost_seconds is not None:  # unpriced: "(no timings)" above says it
        lines.append(f"{indent}  seconds: {t.lost_seconds_basis}")
    if getattr(t, "lost_tokens_basis", None) in TOKEN_BASES:
        lines.append(f"{indent}  tokens: {TOKEN_BASES[t.lost_tokens_basis]}")
    where = [f"prompt token {b.token_offset:,}", f"char {b.char_offset:,} of the rendered prompt"]
    if b.path:
        where.append(f"payload {b.path}")
    lines.append(f"{indent}  where: " + ", ".join(where))
    if b.volatile:
        lines.append(f"{indent}  volatile {b.volatile['kind']}: {b.volatile['before']!r} → {b.volatile['after']!r}")
    if b.diff:
        lines.extend(caret_lines(b.diff, indent + "  "))
    else:
        lines += [f"{indent}  - {b.before!r}", f"{indent}  + {b.after!r}"]
    if b.suggestion:
        lines.append(f"{indent}  fix: {_fix_ref(b.suggestion, said)}")
    return [_plain(line) for line in lines]


def _print_break(buf, console, t, said: dict[str, int] | None = None) -> None:
    console.file.flush() if hasattr(console.file, "flush") else None
    for line in break_lines(t, said=said):
        buf.write(line + "\n")  # not through rich: its wrapping would misalign the caret line


def _fix_groups(report: Report) -> list[dict]:
    """The breaks grouped by cause and fix, costliest first: the groups the Markdown and HTML reports'
    "What to fix" lists (analyzer/report_view.py), so every format names the same fixes."""
    return rv.build(report.to_dict())["groups"]


def _turns_text(breaks: list[dict]) -> str:
    """"session agent-1 turns 2, 3, 4; session b turn 7": where a fix applies, per session."""
    by_session: dict[str, list[int]] = {}
    for b in breaks:
        by_session.setdefault(str(b["session"]), []).append(b["number"])
    parts = []
    for session, numbers in list(by_session.items())[:4]:
        numbers = sorted(numbers)
        shown = ", ".join(f"{n:,}" for n in numbers[:12]) + (" …" if len(numbers) > 12 else "")
        parts.append(f"session {session} turn{'s' * (len(numbers) != 1)} {shown}")
    return "; ".join(parts) + (f"; {len(by_session) - 4} more sessions" if len(by_session) > 4 else "")


def fix_lines(report: Report) -> list[str]:
    """What the text report opens with: the total, then one line per cause and fix (its cost, the
    turns it hit, the fix itself, once), costliest first; "no break" when there is none."""
    groups = _fix_groups(report)
    if not groups:
        return []
    totals = report.to_dict()["totals"]
    lines = [f"What to fix: {plural(totals['breaks'], 'cache break')} cost "
             f"{cost_text(totals['lost_seconds'], totals['lost_tokens'])}"]
    for i, g in enumerate(groups, 1):
        values = f" (values seen: {', '.join(g['values'][:4])}{' …' if len(g['values']) > 4 else ''})" \
            if g["values"] else ""
        lines.append(f"  {i}. {cost_text(g['lost_seconds'], g['lost_tokens'])}, {plural(len(g['breaks']), 'break')}: "
                     f"{g['label']} at {g['breaks'][0]['where']}{values} in {_turns_text(g['breaks'])}: "
                     f"fix: {g['fix'] or 'none known'}")
    lines.append("")
    return lines


def _fix_ref(fix: str, said: dict[str, int] | None) -> str:
    """A fix the report opened with is named by its number there, not said again."""
    number = (said or {}).get(rv.generic_fix(fix or ""))
    return f"#{number} above" if number else fix

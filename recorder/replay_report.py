"""Summaries and renderings of a replay report: text table, JSON, self-contained HTML.

The first target is the baseline: every other target's medians are compared
with it as ratios (target / baseline), so "TTFT ratio 0.5" reads "twice as
fast as the baseline". The HTML page has no external assets: inline SVG
charts (TTFT and cached tokens per turn, one line per target), the medians and
ratios, and the per-turn table; the whole report is embedded as a JSON island
(`JSON.parse(document.getElementById("report").textContent)`), written so that
no recorded text can close its script element.
"""

from __future__ import annotations

import html
import json
import statistics
from pathlib import Path
from typing import Any

from prefixtrace.common.escaping import script_json
from recorder.files import write_private_text

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


def _median(values: list[float | int | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def summarise(turns: list[dict]) -> dict[str, Any]:
    """Medians over the turns answered 2xx without an error; a skipped turn (never sent) is
    counted apart, neither ok nor an error of the target."""
    skipped = sum(1 for t in turns if t.get("skipped"))
    ok = [t for t in turns if 200 <= t["status"] < 300 and not t.get("error") and not t.get("skipped")]
    return {
        "turns": len(turns),
        "ok_turns": len(ok),
        "error_turns": len(turns) - len(ok) - skipped,
        "skipped_turns": skipped,
        "median_ttft_ms": _median([t["ttft_ms"] for t in ok]),
        "median_total_ms": _median([t["total_ms"] for t in ok]),
        "median_cached_tokens": _median([t["cached_tokens"] for t in ok]),
        "median_prompt_tokens": _median([t["prompt_tokens"] for t in ok]),
        "cached_tokens_reported": any(t["cached_tokens"] is not None for t in ok),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def compare(entries: list[dict]) -> dict[str, Any]:
    """Medians of every target as ratios to the first (the baseline)."""
    if not entries:
        return {}
    base = entries[0]["summary"]
    return {
        "baseline": entries[0]["url"],
        "targets": [
            {
                "url": e["url"],
                "ttft_ratio": _ratio(e["summary"]["median_ttft_ms"], base["median_ttft_ms"]),
                "total_ratio": _ratio(e["summary"]["median_total_ms"], base["median_total_ms"]),
                "cached_tokens_ratio": _ratio(e["summary"]["median_cached_tokens"], base["median_cached_tokens"]),
            }
            for e in entries
        ],
    }


def _q(value: Any) -> str:
    return "?" if value is None else str(value)


def _rows(report: dict) -> list[tuple[str | None, int]]:
    seen: dict[tuple[str | None, int], None] = {}
    for target in report["targets"]:
        for t in target["turns"]:
            seen.setdefault((t["session"], t["index"]), None)
    return list(seen)


def format_replay(report: dict) -> str:
    """Per-turn table (one column group per target), then medians and ratios."""
    targets = report["targets"]
    by_target = [{(t["session"], t["index"]): t for t in target["turns"]} for target in targets]
    lines = [f"[{k}] {t['url']}" + (f"  ERROR: {t['error']}" if t.get("error") else "") for k, t in enumerate(targets)]
    header = f"{'session':<20} {'#':>3}" + "".join(
        f" | [{k}] {'status':>6} {'prompt':>7} {'cached':>7} {'rec.':>7} {'ttft ms':>9} {'total ms':>9}"
        for k in range(len(targets)))
    lines += ["", header]
    errors = []
    for key in _rows(report):
        cells = f"{(key[0] or '-')[:20]:<20} {key[1]:>3}"
        for k, turns in enumerate(by_target):
            t = turns.get(key)
            if t is None:
                cells += f" | [{k}] {'-':>6} {'':>7} {'':>7} {'':>7} {'':>9} {'':>9}"
                continue
            if t.get("skipped"):
                cells += f" | [{k}] {'skip':>6} {'':>7} {'':>7} {'':>7} {'':>9} {'':>9}"
                continue
            cells += (f" | [{k}] {t['status']:>6} {_q(t['prompt_tokens']):>7} {_q(t['cached_tokens']):>7} "
                      f"{_q(t['recorded_cached_tokens']):>7} {_q(t['ttft_ms']):>9} {t['total_ms']:>9}")
            if t.get("error") and not targets[k].get("error"):
                errors.append(f"  [{k}] {key[0] or '-'} #{key[1]}: {t['error'][:120]}")
        lines.append(cells)
    if errors:
        lines += ["", "errors:", *errors]
    skipped = [f"  [{k}] {s['session'] or '-'} #{s['index']} ({s['request_id']}): {s['reason']}"
               for k, target in enumerate(targets) for s in target.get("skipped") or []]
    if skipped:
        lines += ["", "skipped (not sent):", *skipped]
    lines.append("")
    comparison = report.get("comparison") or {}
    for k, (target, ratios) in enumerate(zip(targets, comparison.get("targets", []))):
        s = target["summary"]
        skipped_note = f" ({s['skipped_turns']} skipped)" if s.get("skipped_turns") else ""
        lines.append(f"[{k}] ok {s['ok_turns']}/{s['turns']}{skipped_note}  median ttft {_q(s['median_ttft_ms'])} ms"
                     f"  total {_q(s['median_total_ms'])} ms  cached {_q(s['median_cached_tokens'])}"
                     + ("" if k == 0 else f"  ratios vs [0]: ttft {_q(ratios['ttft_ratio'])}"
                                          f" total {_q(ratios['total_ratio'])} cached {_q(ratios['cached_tokens_ratio'])}"))
    return "\n".join(lines)


def _chart(report: dict, key: str, title: str, unit: str) -> str:
    rows = _rows(report)
    index = {r: i for i, r in enumerate(rows)}
    width, height, pad = 860, 260, 48
    series = [[(index[(t["session"], t["index"])], t[key]) for t in target["turns"] if t[key] is not None]
              for target in report["targets"]]
    top = max((v for s in series for _, v in s), default=0) or 1
    n = max(len(rows) - 1, 1)

    def xy(i: int, v: float) -> str:
        return f"{pad + i * (width - 2 * pad) / n:.1f},{height - pad - v * (height - 2 * pad) / top:.1f}"

    parts = [f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">',
             f'<text x="{pad}" y="20" font-weight="bold">{html.escape(title)}</text>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#888"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#888"/>',
             f'<text x="4" y="{pad + 4}" font-size="11">{top:g} {unit}</text>',
             f'<text x="4" y="{height - pad}" font-size="11">0</text>',
             f'<text x="{width / 2:.0f}" y="{height - 12}" font-size="11">turn (sessions in order)</text>']
    for k, points in enumerate(series):
        color = _COLORS[k % len(_COLORS)]
        if points:
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" '
                         f'points="{" ".join(xy(i, v) for i, v in points)}"/>')
            parts += [f'<circle cx="{xy(i, v).split(",")[0]}" cy="{xy(i, v).split(",")[1]}" r="2.5" fill="{color}">'
                      f'<title>[{k}] turn {i}: {v} {unit}</title></circle>' for i, v in points]
        else:
            parts.append(f'<text x="{pad + 10}" y="{40 + 14 * k}" font-size="11" fill="{color}">'
                         f'[{k}] reports no {html.escape(key)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_html(report: dict) -> str:
    """A self-contained HTML page for the report (no scripts, no external assets)."""
    targets = report["targets"]
    comparison = (report.get("comparison") or {}).get("targets", [{}] * len(targets))
    legend = "".join(
        f'<li><span style="color:{_COLORS[k % len(_COLORS)]}">&#9632;</span> [{k}] {html.escape(t["url"])}'
        + (f' <b>error: {html.escape(t["error"])}</b>' if t.get("error") else "") + "</li>"
        for k, t in enumerate(targets))
    summary_rows = "".join(
        f"<tr><td>[{k}]</td><td>{t['summary']['ok_turns']}/{t['summary']['turns']}</td>"
        f"<td>{_q(t['summary']['median_ttft_ms'])}</td><td>{_q(t['summary']['median_total_ms'])}</td>"
        f"<td>{_q(t['summary']['median_cached_tokens'])}</td><td>{_q(r.get('ttft_ratio'))}</td>"
        f"<td>{_q(r.get('total_ratio'))}</td><td>{_q(r.get('cached_tokens_ratio'))}</td></tr>"
        for k, (t, r) in enumerate(zip(targets, comparison)))
    by_target = [{(t["session"], t["index"]): t for t in target["turns"]} for target in targets]
    head = "".join(f"<th>[{k}] status</th><th>[{k}] prompt</th><th>[{k}] cached</th><th>[{k}] ttft ms</th>"
                   f"<th>[{k}] total ms</th><th>[{k}] error</th>" for k in range(len(targets)))
    body = []
    for key in _rows(report):
        cells = f"<td>{html.escape(key[0] or '-')}</td><td>{key[1]}</td>"
        for turns in by_target:
            t = turns.get(key) or {}
            cells += "".join(f"<td>{html.escape(_q(t.get(c)))}</td>" for c in
                             ("status", "prompt_tokens", "cached_tokens", "ttft_ms", "total_ms"))
            note = f"skipped: {t['skipped']}" if t.get("skipped") else (t.get("error") or "")
            cells += f"<td>{html.escape(note[:200])}</td>"
        body.append(f"<tr>{cells}</tr>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>prefixtrace replay</title>
<style>body{{font-family:sans-serif;margin:24px}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}ul{{list-style:none;padding:0}}</style></head>
<body><h1>prefixtrace replay</h1>
<ul>{legend}</ul>
<h2>Medians (ratios: target / [0])</h2>
<table><tr><th>target</th><th>ok</th><th>TTFT ms</th><th>total ms</th><th>cached tokens</th>
<th>TTFT ratio</th><th>total ratio</th><th>cached ratio</th></tr>{summary_rows}</table>
<h2>Per turn</h2>
{_chart(report, "ttft_ms", "Time to first token per turn", "ms")}
{_chart(report, "cached_tokens", "Cached prompt tokens per turn", "tokens")}
<table><tr><th>session</th><th>#</th>{head}</tr>{"".join(body)}</table>
<script type="application/json" id="report">{script_json(report)}</script>
</body></html>
"""


def write_report(report: dict, path: str | Path) -> None:
    """JSON, or the HTML page when `path` ends in .html / .htm; the file 0600 (it holds session ids)."""
    p = Path(path)
    if p.suffix.lower() in (".html", ".htm"):
        write_private_text(p, render_html(report))
    else:
        write_private_text(p, json.dumps(report, indent=2) + "\n")

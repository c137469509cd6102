"""The HTML report: one self-contained file (no external assets), a
per-session timeline (stacked bars per turn: cached vs re-prefilled tokens,
the re-prefilled part coloured by the break's cause) and the diff window of
every break. Charts are inline SVG, so the file renders without scripts; a
tiny script only marks the document as rendered (tests use it).

Everything in the report that came from a client (session ids, roles, tool
and parameter names inside a subtype, the diff windows) is HTML-escaped where
it is interpolated, and the totals reach the script as a JSON island that no
text can close (docs/SECURITY.md).
"""

from __future__ import annotations

import html

from analyzer.analysis import Report
from analyzer.causes import CAUSES
from prefixtrace.escaping import script_json

COLOURS = dict(zip(CAUSES, ("#9aa5b1", "#d64545", "#e8833a", "#8e44ad", "#2d7dd2", "#f2c14e", "#3c9d5d",
                             "#c2185b", "#00897b", "#6d4c41", "#546e7a")))
CACHED = "#cfd8dc"
BAR_W, GAP, HEIGHT = 6, 1, 120


def _svg(session) -> str:
    turns = [t for t in session.turns if t.prompt_tokens is not None]
    top = max((t.prompt_tokens for t in turns), default=1) or 1
    width = max(1, len(session.turns)) * (BAR_W + GAP)
    bars = []
    for t in session.turns:
        if t.prompt_tokens is None:
            continue
        x = t.index * (BAR_W + GAP)
        cached_h = HEIGHT * (t.common_prefix_tokens or 0) / top
        re_h = HEIGHT * (t.reprefill_tokens or 0) / top
        colour = COLOURS[t.brk.cause] if t.brk else COLOURS["append_only"]
        tip = html.escape(f"turn {t.index}: {t.prompt_tokens:,} tokens, {t.common_prefix_tokens:,} cached, "
                          f"{t.reprefill_tokens:,} re-prefilled" + (f" ({t.brk.cause})" if t.brk else ""))
        bars.append(f'<g class="turn{" break" if t.brk else ""}"><title>{tip}</title>'
                    f'<rect x="{x}" y="{HEIGHT - cached_h:.1f}" width="{BAR_W}" height="{cached_h:.1f}" fill="{CACHED}"/>'
                    f'<rect x="{x}" y="{HEIGHT - cached_h - re_h:.1f}" width="{BAR_W}" height="{re_h:.1f}" fill="{colour}"/></g>')
    # Scaled to the page width: a 300-turn session still fits on one screen.
    return (f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" width="{min(width * 2, 1200)}" '
            f'height="{HEIGHT}" viewBox="0 0 {width} {HEIGHT}" preserveAspectRatio="none">{"".join(bars)}</svg>')


def to_html(report: Report) -> str:
    d = report.to_dict()
    esc = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>prefixtrace analysis</title><style>",
        "body{font:14px system-ui,sans-serif;margin:1.5em}pre{background:#f6f8fa;padding:.5em;white-space:pre-wrap;"
        "word-break:break-all}.del{background:#ffebe9}.ins{background:#e6ffec}.legend span{display:inline-block;"
        "margin-right:1em}.legend i{display:inline-block;width:.9em;height:.9em;margin-right:.3em}"
        "svg.timeline{border-bottom:1px solid #999;display:block;margin:.5em 0}table{border-collapse:collapse}"
        "td,th{padding:2px 8px;border-bottom:1px solid #eee;text-align:right}",
        "</style></head><body>",
        "".join(f'<p class="warning" style="background:#fff3cd;padding:.5em"><b>warning:</b> {esc(w)}</p>'
                for w in report.warnings()),
        f"<h1>prefixtrace analysis</h1><p>renderer: <code>{esc(report.renderer)}</code> · tokenizer: "
        f"<code>{esc(report.tokenizer)}</code> · {d['totals']['reprefill_tokens']:,} of "
        f"{d['totals']['prompt_tokens']:,} prompt tokens re-prefilled</p>",
        '<p class="legend">' + f'<span><i style="background:{CACHED}"></i>cached</span>'
        + "".join(f'<span><i style="background:{c}"></i>{n}</span>' for n, c in COLOURS.items()) + "</p>",
    ]
    if d["totals"]["by_cause"]:
        parts.append("<table><tr><th>cause</th><th>breaks</th><th>re-prefilled tokens</th></tr>")
        for cause, c in d["totals"]["by_cause"].items():
            parts.append(f"<tr><td>{esc(cause)}</td><td>{c['breaks']}</td><td>{c['reprefill_tokens']:,}</td></tr>")
        parts.append("</table>")
    if report.what_if:
        parts.append('<table class="what-if"><tr><th>what if</th><th>rules</th><th>cached</th><th>re-prefilled</th>'
                     "<th>lost to</th></tr>")
        for w in report.what_if:
            lost = ", ".join(f"{k} {v:,}" for k, v in w["lost_to"].items())
            parts.append(f"<tr><td>{esc(w['policy'])}</td><td>{esc(w['rules'])}</td><td>{w['cached_tokens']:,}</td>"
                         f"<td>{w['reprefill_tokens']:,}</td><td>{esc(lost)}</td></tr>")
        parts.append("</table>")
    for skipped in report.skipped:
        parts.append(f"<p>skipped line {skipped['line']}: {esc(skipped['error'])}</p>")
    if report.failed:  # refused by the server: listed, not chained
        parts.append('<div class="failed"><h2>failed requests (listed, not chained)</h2><ul>'
                     + "".join(f"<li>status {f['status']}, session {esc(str(f['session']))}: {esc(f['error'] or '')}</li>"
                               for f in report.failed) + "</ul></div>")
    for s in report.sessions:
        breaks = [t for t in s.turns if t.brk]
        side = f", side request of {s.parent}: {s.side_reason}" if s.parent else ""
        parts.append(f'<section class="session" data-session="{esc(s.id)}"><h2>session {esc(s.id)}</h2>'
                     f"<p>{len(s.turns)} turns, {len(breaks)} break(s){esc(side)}</p>{_svg(s)}")
        if s.transcript:  # rebuilt from a harness's own file, not recorded: say what it lacks
            parts.append(f'<p class="transcript">rebuilt from a transcript of {esc(str(s.transcript.get("harness")))} '
                         f'({esc(str(s.transcript.get("file")))}); not rebuilt: '
                         f'{esc("; ".join(s.transcript.get("not_rebuilt") or []) or "nothing")}</p>')
        for t in breaks:
            b = t.brk
            kind = esc(f"{b.cause}{'/' + b.subtype if b.subtype else ''}")  # a subtype can be a client's role
            parts.append(f'<div class="break" data-cause="{esc(b.cause)}"><h3>turn {t.index}: {kind}'
                         f"</h3><p>{esc(b.where())},"
                         f" char {b.char_offset:,}, token {b.token_offset:,}, {t.reprefill_tokens:,} tokens re-prefilled"
                         + (f", payload <code>{esc(b.path)}</code>" if b.path else "") + "</p>"
                         f'<pre class="del">- {esc(b.before)}</pre><pre class="ins">+ {esc(b.after)}</pre>'
                         + (f'<p class="fix">fix (saves {b.saves_tokens:,} tokens): {esc(b.suggestion)}</p>'
                            if b.suggestion else "") + "</div>")
        parts.append("</section>")
    parts.append(f'<script type="application/json" id="totals">{script_json(d["totals"])}</script>'
                 "<script>document.body.dataset.rendered = String(document.querySelectorAll('svg.timeline').length);"
                 "window.prefixtraceReport = JSON.parse(document.getElementById('totals').textContent);</script>"
                 "</body></html>")
    return "".join(parts)

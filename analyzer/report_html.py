"""The HTML report: one self-contained page (inline CSS, SVG and script; nothing fetched).

It opens on the answer: what the breaks cost (seconds first, then tokens), per cause, and the top
breaks by cost, each a link to its detail. Then one card per cause + fix, listing every turn it hit
(not one card per turn), the diff of each with the differing characters marked; a timeline per
session (turn on x, prompt tokens on y: cached vs re-prefilled, breaks marked and clickable); and
a sortable, filterable turn table built from a JSON island, so 10,000 turns stay usable.

Everything that came from a client (session ids, titles, roles, tool names, diff windows) is
HTML-escaped at each interpolation, and the JSON island goes through `script_json`, which no text
can close (docs/SECURITY.md).
"""

from __future__ import annotations

import html
import math
from typing import Any

from analyzer import report_view as rv
from analyzer.fix_report import lines_for
from analyzer.report_assets import CSS, JS
from analyzer.server_counts import TOKEN_BASES
from prefixtrace.common.escaping import script_json
from prefixtrace.common.words import plural

esc = html.escape
W, H = 960, 210  # the timeline's viewBox; it scales to the page width
ML, MR, MT, MB = 62, 26, 16, 34
BARS_UP_TO = 600  # turns per session drawn as bars; beyond, as areas (a bar would be under a pixel)


def _n(value) -> str:
    return "?" if value is None else f"{value:,}"


def _short(value: float) -> str:
    if value >= 1_000_000:
        return f"{value / 1_000_000:g}M"
    if value >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def _nice(top: float) -> tuple[float, float]:
    """(axis maximum, tick step): a round step, four or five ticks."""
    top = max(top, 1)
    raw = top / 4
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return step * math.ceil(top / step), step


def cost_text(seconds, tokens) -> str:
    """"4.1 s · 1,030 tokens": seconds first; tokens alone when no timing is known."""
    if seconds is None:
        return f"{_n(tokens)} tokens"
    return f"{rv.seconds_text(seconds)} · {_n(tokens)} tokens"


def diff_html(diff: tuple[str, str, int, int, int]) -> str:
    before, after, start, bend, aend = diff
    b = f"{esc(before[:start])}<del>{esc(before[start:bend])}</del>{esc(before[bend:])}"
    a = f"{esc(after[:start])}<ins>{esc(after[start:aend])}</ins>{esc(after[aend:])}"
    return (f'<div class="diff"><div><div class="label">before (previous prompt)</div><pre class="before">{b}</pre>'
            f'</div><div><div class="label">after (this prompt)</div><pre class="after">{a}</pre></div></div>')


def timeline(s: dict[str, Any]) -> str:
    """Inline SVG: x = turn number, y = prompt tokens; cached (grey) under re-prefilled (appended in
    light blue, a break's in its cause colour); every break marked on top and linked to its detail."""
    rows = s["rows"]
    n = max(1, len(rows))
    top, step = _nice(max((r["prompt"] or 0 for r in rows), default=1))
    pw, ph = W - ML - MR, H - MT - MB

    def x(i: float) -> float:
        return ML + pw * i / n

    def y(v: float) -> float:
        return MT + ph * (1 - v / top)

    out = [f'<svg class="timeline" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" role="img" '
           f'aria-label="prompt tokens per turn">']
    ticks = int(round(top / step))
    for k in range(ticks + 1):
        v = k * step
        out.append(f'<line class="grid" x1="{ML}" x2="{W - MR}" y1="{y(v):.1f}" y2="{y(v):.1f}"/>'
                   f'<text x="{ML - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{_short(v)}</text>')
    out.append(f'<text transform="translate(14 {MT + ph / 2:.0f}) rotate(-90)" text-anchor="middle">'
               f'prompt tokens</text>')
    xstep = int(_nice(n)[1]) if n > 8 else 1
    labels = sorted({1, *range(xstep, n + 1, xstep)})
    if len(labels) > 1 and labels[1] - labels[0] < xstep / 2:
        labels.pop(1)  # "1" and "2" would overlap under a step of 2,000
    for label in labels:
        out.append(f'<line class="axis" x1="{x(label - 0.5):.1f}" x2="{x(label - 0.5):.1f}" y1="{MT + ph}" '
                   f'y2="{MT + ph + 4}"/><text x="{x(label - 0.5):.1f}" y="{MT + ph + 16}" '
                   f'text-anchor="middle">{label:,}</text>')
    out.append(f'<text x="{ML + pw / 2:.0f}" y="{H - 3}" text-anchor="middle">turn</text>')
    out.append(f'<line class="axis" x1="{ML}" x2="{W - MR}" y1="{MT + ph}" y2="{MT + ph}"/>'
               f'<line class="axis" x1="{ML}" x2="{ML}" y1="{MT}" y2="{MT + ph}"/>')
    if len(rows) <= BARS_UP_TO:
        slot = pw / n
        bw = min(max(slot * 0.8, 0.6), 28)  # a 3-turn session gets bars, not slabs
        for i, r in enumerate(rows):
            if r["prompt"] is None:
                continue
            cached = min(r["cached"] or 0, r["prompt"])
            re = max(0, r["prompt"] - cached)
            fill = rv.colour(r["cause"].split("/")[0]) if r["cause"] else rv.APPEND
            tip = (f"turn {r['n']}: {_n(r['prompt'])} prompt tokens, {_n(cached)} cached, {_n(re)} re-prefilled"
                   + (f", TTFT {rv.seconds_text(r['ttft'])}" if r["ttft"] is not None else "")
                   + (f" — {r['cause']}, lost {cost_text(r['sec'], r['lost'])}" if r["cause"] else ""))
            bar = (f'<g class="turn" data-turn="{r["n"]}"><title>{esc(tip)}</title>'
                   f'<rect x="{x(i + 0.5) - bw / 2:.2f}" y="{y(cached):.1f}" width="{bw:.2f}" '
                   f'height="{y(0) - y(cached):.1f}" fill="{rv.CACHED}"/>'
                   f'<rect x="{x(i + 0.5) - bw / 2:.2f}" y="{y(cached + re):.1f}" width="{bw:.2f}" '
                   f'height="{y(cached) - y(cached + re):.1f}" fill="{fill}"/></g>')
            out.append(bar)
    else:  # areas: the prompt's size, and under it the cached part
        def area(values) -> str:
            pts = " ".join(f"L{x(i + 0.5):.1f},{y(v or 0):.1f}" for i, v in enumerate(values))
            return f"M{x(0.5):.1f},{y(0):.1f} {pts} L{x(n - 0.5):.1f},{y(0):.1f} Z"

        out.append(f'<path d="{area([r["prompt"] for r in rows])}" fill="{rv.APPEND}"/>'
                   f'<path d="{area([min(r["cached"] or 0, r["prompt"] or 0) for r in rows])}" fill="{rv.CACHED}"/>')
    marked = sum(1 for r in rows if r["id"])
    hw = max(1.5, min(5.0, pw / max(1, marked) / 2))  # 200 breaks in a session: marks that do not overlap
    for i, r in enumerate(rows):
        if not r["id"]:
            continue
        c = rv.colour(r["cause"].split("/")[0])
        cx = x(i + 0.5)
        tip = f"turn {r['n']}: {r['cause']}, lost {cost_text(r['sec'], r['lost'])} (click for the diff)"
        guide = (f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{MT}" y2="{MT + ph}" stroke="{c}" stroke-opacity=".35" '
                 f'stroke-dasharray="3 2"/>') if marked <= 60 else ""
        out.append(f'<a href="#{r["id"]}" class="break-mark" data-turn="{r["n"]}"><title>{esc(tip)}</title>{guide}'
                   f'<path class="marker" d="M{cx - hw:.1f},{MT - 9} L{cx + hw:.1f},{MT - 9} L{cx:.1f},{MT - 1} Z" '
                   f'fill="{c}"/></a>')
    out.append("</svg>")
    return "".join(out)


def _legend(causes: list[str]) -> str:
    items = [(rv.CACHED, "cached (reused from the previous turn)"), (rv.APPEND, "appended (new tokens)")]
    items += [(rv.colour(c), rv.LABELS.get(c, c)) for c in causes]
    return '<div class="legend">' + "".join(
        f'<span><i class="swatch" style="background:{c}"></i>{esc(t)}</span>' for c, t in items) \
        + "<span>▼ a break: click it for the diff</span></div>"


def _break_detail(b: dict[str, Any], sessions: list[dict], open_: bool) -> str:
    s = sessions[b["session_index"]]
    facts = [f"re-prefilled {cost_text(b['lost_seconds'], b['lost_tokens'])}"]
    if b.get("lost_dollars") is not None:
        facts.append(f"{rv.dollars_text(b['lost_dollars'])} at the priced model's rates")
    if b["basis"]:
        facts.append(f"seconds from {b['basis']}")
    if b.get("tokens_basis") in TOKEN_BASES:
        facts.append(f"tokens: {TOKEN_BASES[b['tokens_basis']]}")
    if b["ttft"] is not None:
        facts.append(f"TTFT {rv.seconds_text(b['ttft'])}")
    if b["token_offset"] is not None:
        facts.append(f"cache stopped at token {_n(b['token_offset'])}")
    if b["path"]:
        facts.append(f"payload {b['path']}")
    if b.get("server_miss_reason"):
        facts.append(f"the server's reason: {b['server_miss_reason']}")
    if b.get("served_by"):
        facts.append(f"served by {b['served_by']}")
    vol = b.get("volatile")
    if isinstance(vol, dict) and vol.get("kind"):
        facts.append(f"volatile {vol['kind']}: {vol.get('before', '')!s} → {vol.get('after', '')!s}")
    return (f'<details class="break" id="{b["id"]}" data-cause="{esc(b["cause"])}" data-turn="{b["number"]}"'
            f'{" open" if open_ else ""}><summary><h3>turn {b["number"]:,}: {esc(b["kind"])}</h3> of {esc(rv.session_name(s))} · '
            f'{esc(cost_text(b["lost_seconds"], b["lost_tokens"]))} · at {esc(b["where"])}</summary>'
            f'<p class="meta">{esc("; ".join(facts))}</p>{diff_html(b["diff"])}</details>')


def _summary(v: dict[str, Any]) -> str:
    h = v["headline"]
    if h["breaks"]:
        secs = (f"<b>{rv.seconds_text(h['lost_seconds'])}</b> and " if h["lost_seconds"] is not None else "")
        usd = f" (<b>{rv.dollars_text(h['lost_dollars'])}</b>)" if h.get("lost_dollars") is not None else ""
        head = (f'<p class="headline" id="headline">{h["breaks"]:,} cache break{"s" * (h["breaks"] != 1)} cost '
                f'{secs}<b>{h["lost_tokens"]:,}</b> re-prefilled tokens{usd}</p>')
    else:
        head = '<p class="headline" id="headline">No cache break: every turn only appended to the previous prompt.</p>'
    reuse = h["cached_tokens"] / h["prompt_tokens"] if h["prompt_tokens"] else 0
    parts = [head, f'<p class="sub">Apart from that, {h["appended_tokens"]:,} new tokens were appended '
                   f"(prefilled too, but no cache could have served them). {plural(h['turns'], 'turn')} in "
                   f"{plural(h['sessions'], 'session')}; {h['cached_tokens']:,} of {h['prompt_tokens']:,} prompt tokens "
                   f"({reuse:.0%}) were a prefix of the previous turn's prompt.</p>"]
    if h["breaks"] and h["lost_seconds"] is None:
        parts.append('<p class="sub">No timing for the breaks: record TTFT through the proxy, or pass '
                     "<code>--prefill-rate</code>, to see seconds.</p>")
    if v["by_cause"]:
        parts.append('<table class="data" id="by-cause"><thead><tr><th class="l">cause</th><th>breaks</th>'
                     "<th>seconds lost</th><th>tokens re-prefilled</th></tr></thead><tbody>")
        for c in v["by_cause"]:
            parts.append(f'<tr><td class="l"><i class="swatch" style="background:{rv.colour(c["cause"])}"></i>'
                         f'{esc(c["label"])} <span class="code">{esc(c["cause"])}</span></td><td>{c["breaks"]:,}</td>'
                         f'<td>{rv.seconds_text(c["lost_seconds"]) if c["lost_seconds"] is not None else "–"}</td>'
                         f'<td>{c["lost_tokens"]:,}</td></tr>')
        parts.append("</tbody></table>")
    if v["top"]:
        top = f"Top {len(v['top'])} breaks" if len(v["top"]) > 1 else "The break"
        parts.append(f'<h3 style="margin-top:14px">{top} by cost</h3><ol class="top" id="top-breaks">')
        for b in v["top"]:
            s = v["sessions"][b["session_index"]]
            parts.append(f'<li><span class="cost">{esc(cost_text(b["lost_seconds"], b["lost_tokens"]))}</span> '
                         f'<a href="#{b["id"]}">turn {b["number"]:,} of {esc(rv.session_name(s))}</a>: '
                         f'{esc(b["label"])} at {esc(b["where"])}</li>')
        parts.append("</ol>")
    return '<section class="panel" id="summary"><h2>Summary</h2>' + "".join(parts) + "</section>"


def _groups(v: dict[str, Any]) -> str:
    if not v["groups"]:
        return ""
    out = ['<section class="panel" id="fixes"><h2>What to fix</h2><p class="sub">One card per cause and fix; '
           "every turn it hit is listed, the costliest first.</p>"]
    for gi, g in enumerate(v["groups"]):
        bs = g["breaks"]
        links = " ".join(f'<a href="#{b["id"]}">{b["number"]:,}</a>' for b in bs)
        sessions = sorted({b["session_index"] for b in bs})
        where = f" in {len(sessions)} sessions" if len(sessions) > 1 else ""
        fix = f'<p class="fix"><b>Fix:</b> {esc(g["fix"])}</p>' if g["fix"] else ""
        out.append(f'<div class="group" id="g{gi}" data-cause="{esc(g["cause"])}" style="border-left-color:'
                   f'{rv.colour(g["cause"])}"><span class="cost">{esc(cost_text(g["lost_seconds"], g["lost_tokens"]))}'
                   f'</span><h3>{esc(g["label"])} <span class="code">{esc(g["kind"])}</span></h3>'
                   f'<p class="meta">{len(bs):,} break{"s" * (len(bs) != 1)}{where}</p>{fix}'
                   + (f'<p class="meta values">values seen: {esc(", ".join(g["values"]))}'
                      f'{" …" if len(bs) > len(g["values"]) else ""}</p>' if g["values"] else "")
                   + f'<p class="turnlinks">turns: {links}</p>'
                   + "".join(_break_detail(b, v["sessions"], open_=(j == 0)) for j, b in enumerate(bs)) + "</div>")
    out.append("</section>")
    return "".join(out)


def _transcript(s: dict[str, Any]) -> str:
    """A session rebuilt from a harness's own file, not recorded: say so, and what the file lacks."""
    t = s.get("transcript")
    if not t:
        return ""
    lacks = "; ".join(t.get("not_rebuilt") or []) or "nothing"
    return (f'<p class="transcript">rebuilt from a transcript of {esc(str(t.get("harness")))} '
            f'({esc(str(t.get("file")))}); not rebuilt: {esc(lacks)}</p>')


def _sessions(v: dict[str, Any]) -> str:
    out = ['<section class="panel" id="sessions"><h2>Sessions</h2><p class="sub">The costliest first.</p>']
    for s in sorted(v["sessions"], key=rv.cost_key):
        causes = sorted({r["cause"].split("/")[0] for r in s["rows"] if r["cause"]})
        side = f", side request of {s['parent']}: {s['side_reason']}" if s.get("parent") else ""
        out.append(f'<section class="session" data-session="{esc(str(s["id"]))}" id="s{s["index"]}">'
                   f'<h3>{esc(rv.session_name(s))}</h3><p class="meta">{plural(len(s["rows"]), "turn")}, '
                   f'{plural(s["breaks"], "break")}'
                   + (f' costing {esc(cost_text(s["lost_seconds"], s["lost_tokens"]))}' if s["breaks"] else "")
                   + f'{esc(side)}</p>{_transcript(s)}{timeline(s)}{_legend(causes)}</section>')
    out.append("</section>")
    return "".join(out)


def _table(v: dict[str, Any]) -> str:
    causes = sorted({r["cause"].split("/")[0] for r in v["rows"] if r["cause"]})
    opts = "".join(f'<option value="{esc(c)}">{esc(rv.LABELS.get(c, c))}</option>' for c in causes)
    sess = "".join(f'<option value="{s["index"]}">{esc(rv.session_name(s))}</option>' for s in v["sessions"])
    return ('<section class="panel" id="turns"><h2>Turns</h2><div class="controls">'
            '<input type="search" id="filter" placeholder="filter: session, cause, note, turn…">'
            '<select id="cause-filter"><option value="">all turns</option><option value="breaks">breaks only</option>'
            f'<option value="appends">appends only</option>{opts}</select>'
            f'<select id="session-filter"><option value="">all sessions</option>{sess}</select>'
            '<span class="pager"><button id="prev-page">‹ prev</button><button id="next-page">next ›</button></span>'
            '<span id="turn-count" class="meta"></span></div>'
            '<div class="scroll"><table class="data" id="turn-table"><thead><tr id="turn-head"></tr></thead>'
            '<tbody id="turn-rows"></tbody></table></div>'
            '<p class="meta">Click a column to sort; “lost” is the break\'s cost in seconds.</p>'
            "</section>")


def _extras(d: dict[str, Any]) -> str:
    out = []
    fixes = lines_for(d.get("proxy_fixes"), d.get("fix_proposals"))  # analyzer/fix_report.py
    if fixes:
        out.append('<section class="panel" id="proxy-fixes"><h2>Fixes: applied and proposed</h2><ul>'
                   + "".join(f"<li>{esc(line)}</li>" for line in fixes) + "</ul></section>")
    if d.get("what_if"):
        out.append('<section class="panel" id="what-if"><h2>What if another cache served this</h2>'
                   '<table class="data what-if"><tr><th class="l">cache</th><th class="l">rules</th><th>cached</th>'
                   "<th>re-prefilled</th><th class=\"l\">lost to</th><th>dollars (this cache / none)</th></tr>")
        for w in d["what_if"]:
            lost = ", ".join(f"{k} {v:,}" for k, v in w["lost_to"].items())
            usd = w.get("dollars") or {}
            usd_text = (f"{rv.dollars_text(usd.get('this_cache'))} / {rv.dollars_text(usd.get('no_cache'))}"
                        if usd else "–")
            out.append(f'<tr><td class="l">{esc(w["policy"])}</td><td class="l wrap">{esc(w["rules"])}</td>'
                       f'<td>{w["cached_tokens"]:,}</td><td>{w["reprefill_tokens"]:,}</td>'
                       f'<td class="l">{esc(lost)}</td><td>{usd_text}</td></tr>')
        out.append("</table></section>")
    skipped, failed = d.get("skipped_lines") or [], d.get("failed_requests") or []
    if skipped or failed:
        out.append('<section class="panel" id="not-analysed"><h2>Not analysed</h2>')
        out += [f"<p>skipped line {s.get('line')}: {esc(str(s.get('error')))}</p>" for s in skipped]
        if failed:
            out.append('<div class="failed"><h3>failed requests (listed, not chained)</h3><ul>'
                       + "".join(f"<li>status {f.get('status')}, session {esc(str(f.get('session')))}: "
                                 f"{esc(str(f.get('error') or ''))}</li>" for f in failed) + "</ul></div>")
        out.append("</section>")
    return "".join(out)


def _island(d: dict[str, Any], v: dict[str, Any]) -> str:
    rows = [[r["s"], r["n"], r["ts"], r["prompt"], r["cached"], r["re"], r["rcached"], r["ttft"], r["cause"],
             r["sec"], r["lost"], r["note"][:160], r["id"]] for r in v["rows"]]
    data = {"sessions": [rv.session_name(s) for s in v["sessions"]], "rows": rows,
            "totals": d.get("totals") or {}, "headline": v["headline"]}
    return f'<script type="application/json" id="report-data">{script_json(data)}</script>'


def render(d: dict[str, Any], title: str = "prefixtrace analysis") -> str:
    """The page for `Report.to_dict()` (or a dict of the same shape)."""
    v = rv.build(d)
    note = d.get("renderer_note")
    pricing = d.get("pricing") or {}
    if pricing.get("model"):
        note = "; ".join(x for x in (note, f"dollars as {pricing['model']} ({pricing.get('provider')}), genai-prices")
                         if x)
    meta = (f"renderer <code>{esc(str(d.get('renderer')))}</code> · tokenizer <code>{esc(str(d.get('tokenizer')))}"
            "</code>" + (f" · {esc(str(note))}" if note else "")
            + (f" · prefill rate {d['prefill_rate']:g} tok/s" if d.get("prefill_rate") else ""))
    warnings = "".join(f'<p class="warning"><b>warning:</b> {esc(str(w))}</p>' for w in d.get("warnings") or [])
    return "".join([
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{esc(title)}</title>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<style>{CSS}</style></head><body>", warnings,
        f'<header class="top"><h1>{esc(title)}</h1><p>{meta}</p></header>',
        '<nav class="toc"><a href="#summary">Summary</a><a href="#fixes">What to fix</a>'
        '<a href="#sessions">Sessions</a><a href="#turns">Turns</a></nav><main>',
        _summary(v), _groups(v), _sessions(v), _table(v), _extras(d),
        "</main>", _island(d, v), f"<script>{JS}</script></body></html>",
    ])

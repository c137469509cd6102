"""The HTML report's inline style and script (no network: no CDN, no fonts, nothing fetched).

The script builds the turn table from the JSON island (`#report-data`): sorting, filtering and
paging 10,000 rows in the page costs milliseconds, while 10,000 rows of static HTML would cost the
browser seconds to lay out. It sets text with textContent only: the rows carry client text.
"""

CSS = """
:root{--fg:#1f2933;--muted:#616e7c;--line:#e4e7eb;--bg:#f6f7f9;--accent:#2d7dd2}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;background:var(--bg);color:var(--fg)}
header.top{background:#1f2933;color:#fff;padding:12px 24px}
header.top h1{font-size:19px;margin:0 0 2px}
header.top p{margin:0;color:#cbd2d9;font-size:12.5px}
header.top code{color:#fff}
nav.toc{background:#fff;border-bottom:1px solid var(--line);padding:6px 24px;position:sticky;top:0;z-index:2}
nav.toc a{margin-right:18px;color:var(--accent);text-decoration:none;font-weight:500}
main{padding:16px 24px;max-width:1280px}
section.panel{background:#fff;border:1px solid var(--line);border-radius:6px;padding:14px 18px;margin-bottom:16px}
h2{font-size:17px;margin:0 0 10px}
h3{font-size:15px;margin:0}
.warning{margin:0;background:#fff3cd;border:1px solid #f2d98c;padding:8px 12px;border-radius:4px}
.headline{font-size:18px;margin:0 0 6px}
.headline b{font-size:22px}
.sub{color:var(--muted);margin:2px 0}
.stats{display:flex;gap:28px;flex-wrap:wrap;margin:10px 0 14px}
.stat b{display:block;font-size:20px}
.stat span{color:var(--muted);font-size:12px}
table{border-collapse:collapse}
table.data td,table.data th{padding:4px 10px;border-bottom:1px solid var(--line);text-align:right;white-space:nowrap}
table.data th{font-weight:600;color:var(--muted);font-size:12px;text-transform:none}
table.data td.l,table.data th.l{text-align:left}
#by-cause td.l{white-space:normal}
table.data td.wrap{white-space:normal;max-width:420px;text-align:left}
.swatch{display:inline-block;width:.8em;height:.8em;border-radius:2px;margin-right:6px;vertical-align:-1px}
ol.top{margin:0;padding-left:1.6em}
ol.top li{margin:3px 0}
ol.top .cost{font-weight:600;display:inline-block;min-width:9em}
.code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px;color:var(--muted)}
.group{border:1px solid var(--line);border-left:5px solid #999;border-radius:5px;padding:10px 14px;margin:10px 0}
.group .cost{float:right;font-weight:600}
.group p.fix{background:#eef6ee;border-radius:4px;padding:6px 10px;margin:8px 0}
.group p.fix b{color:#2f6f3e}
.turnlinks a{margin-right:6px}
details.break{border-top:1px dashed var(--line);padding:6px 0}
details.break summary{cursor:pointer}
details.break summary h3{display:inline;font-size:inherit}
details.break.flash{animation:flash 1.6s}
@keyframes flash{0%{background:#fff3bf}100%{background:transparent}}
.diff{display:grid;grid-template-columns:1fr 1fr;gap:10px;margin-top:6px}
.diff .label{font-size:11px;color:var(--muted)}
.diff pre{margin:0;white-space:pre-wrap;word-break:break-all;background:#f5f7fa;padding:6px 8px;border-radius:4px;
  font-size:12px;max-height:220px;overflow:auto}
del{background:#ffc9c9;text-decoration:line-through;text-decoration-color:#c92a2a80}
ins{background:#b2f2bb;text-decoration:none}
.meta{color:var(--muted);font-size:12.5px}
svg.timeline{display:block;width:100%;height:auto;max-width:1100px}
svg.timeline text{font:11px system-ui,sans-serif;fill:#52606d}
svg.timeline .grid{stroke:#eceff1}
svg.timeline .axis{stroke:#9aa5b1}
svg.timeline a:hover .marker{stroke:#1f2933;stroke-width:1.5}
.legend{font-size:12px;color:var(--muted);margin:4px 0 12px}
.legend span{margin-right:14px;white-space:nowrap}
.controls{display:flex;gap:12px;flex-wrap:wrap;align-items:center;margin-bottom:8px}
.controls input[type=search]{width:260px;padding:4px 6px}
.controls select{padding:3px}
.scroll{overflow-x:auto}
#turn-table td:first-child{max-width:220px;overflow:hidden;text-overflow:ellipsis}
#turn-table th{cursor:pointer;user-select:none;white-space:normal;vertical-align:bottom}
#turn-table{width:100%}
#turn-table td.l{white-space:normal;overflow-wrap:anywhere;min-width:9em}
#turn-table th[aria-sort=ascending]::after{content:" ▲"}
#turn-table th[aria-sort=descending]::after{content:" ▼"}
#turn-table tr.brk td{background:#fff8f0}
.pager button{margin:0 4px}
"""

JS = r"""
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const rows = data.rows;  // [session, turn, ts, prompt, cached, re, server_cached, ttft, cause, lost_s, lost_tok, note, id]
  const COLS = [
    ["session", 0, "l"], ["turn", 1], ["prompt tokens", 3], ["cached (predicted)", 4], ["re-prefilled", 5],
    ["cached (server)", 6], ["TTFT", 7], ["break", 8, "l"], ["lost", 9], ["lost tokens", 10], ["note", 11, "l"],
  ];
  const PAGE = 100;
  const state = {sort: null, dir: 1, page: 0, view: rows};
  const $ = (id) => document.getElementById(id);
  const fmt = (v) => (v == null ? "" : typeof v === "number" ? v.toLocaleString("en-US") : String(v));
  const secs = (v) => (v == null ? "" : v >= 120 ? (v / 60).toFixed(1) + " min" : v.toFixed(1) + " s");

  function el(tag, attrs, text) {
    const n = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) n.setAttribute(k, v);
    if (text != null) n.textContent = text;
    return n;
  }

  function apply() {
    const q = $("filter").value.trim().toLowerCase();
    const cause = $("cause-filter").value, sess = $("session-filter").value;
    let view = rows.filter((r) => {
      if (sess !== "" && String(r[0]) !== sess) return false;
      if (cause === "breaks" && !r[8]) return false;
      if (cause === "appends" && r[8]) return false;
      if (cause !== "" && cause !== "breaks" && cause !== "appends" && (r[8] || "").split("/")[0] !== cause) return false;
      if (q && !(data.sessions[r[0]] + " " + (r[8] || "") + " " + r[11] + " " + r[1]).toLowerCase().includes(q)) return false;
      return true;
    });
    if (state.sort != null) {
      const i = state.sort, dir = state.dir;
      const key = i === 0 ? (r) => data.sessions[r[0]] : (r) => r[i];
      view = view.slice().sort((a, b) => {
        const x = key(a), y = key(b);
        if (x == null && y == null) return a[0] - b[0] || a[1] - b[1];
        if (x == null) return 1;
        if (y == null) return -1;
        return (x < y ? -1 : x > y ? 1 : a[0] - b[0] || a[1] - b[1]) * dir;
      });
    }
    state.view = view;
    draw();
  }

  function draw() {
    const view = state.view, pages = Math.max(1, Math.ceil(view.length / PAGE));
    state.page = Math.min(state.page, pages - 1);
    const start = state.page * PAGE, body = $("turn-rows");
    const frag = document.createDocumentFragment();
    for (const r of view.slice(start, start + PAGE)) {
      const tr = el("tr", {"data-session": r[0], "data-turn": r[1]});
      if (r[8]) tr.className = "brk";
      COLS.forEach(([, i, align]) => {
        const td = el("td", align ? {class: align} : {});
        if (i === 0) td.textContent = data.sessions[r[0]];
        else if (i === 8 && r[8]) td.append(el("a", {href: "#" + r[12], class: "to-break"}, r[8]));
        else if (i === 7) td.textContent = secs(r[7]);
        else if (i === 9) td.textContent = secs(r[9]);
        else td.textContent = fmt(r[i]);
        tr.append(td);
      });
      frag.append(tr);
    }
    body.replaceChildren(frag);
    $("turn-count").textContent = view.length ? `turns ${(start + 1).toLocaleString("en-US")}–` +
      `${Math.min(start + PAGE, view.length).toLocaleString("en-US")} of ${view.length.toLocaleString("en-US")}` +
      (view.length !== rows.length ? ` (filtered from ${rows.length.toLocaleString("en-US")})` : "") : "no turn matches";
    $("prev-page").disabled = state.page === 0;
    $("next-page").disabled = state.page >= pages - 1;
  }

  const head = $("turn-head");
  COLS.forEach(([name, i, align]) => {
    const th = el("th", {"data-col": i, ...(align ? {class: align} : {})}, name);
    th.tabIndex = 0;  // sortable from the keyboard too
    th.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); th.click(); } });
    th.addEventListener("click", () => {
      state.dir = state.sort === i ? -state.dir : (i >= 2 && i !== 8 && i !== 11 ? -1 : 1);
      state.sort = i;
      head.querySelectorAll("th").forEach((h) => h.removeAttribute("aria-sort"));
      th.setAttribute("aria-sort", state.dir > 0 ? "ascending" : "descending");
      state.page = 0;
      apply();
    });
    head.append(th);
  });
  for (const id of ["filter", "cause-filter", "session-filter"])
    $(id).addEventListener("input", () => { state.page = 0; apply(); });
  $("prev-page").addEventListener("click", () => { state.page--; draw(); });
  $("next-page").addEventListener("click", () => { state.page++; draw(); });

  // A link to a break (summary, timeline marker, table) opens its detail and brings it into view.
  function reveal() {
    const id = decodeURIComponent(location.hash.slice(1));
    const target = id && document.getElementById(id);
    if (!target || target.tagName !== "DETAILS") return;
    target.open = true;
    target.scrollIntoView({block: "center"});
    target.classList.remove("flash");
    void target.offsetWidth;
    target.classList.add("flash");
  }
  window.addEventListener("hashchange", reveal);
  // Following the same link twice fires no hashchange: reveal on every click of an in-page link.
  document.addEventListener("click", (e) => {
    const a = e.target.closest && e.target.closest("a[href^='#']");
    if (a) setTimeout(reveal, 0);
  });
  apply();
  reveal();
  document.body.dataset.rendered = String(document.querySelectorAll("svg.timeline").length);
  window.prefixtraceReport = data.totals;
})();
"""

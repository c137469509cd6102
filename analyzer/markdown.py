"""`to_markdown(report)`: the report as GitHub-flavoured Markdown, for pasting into an issue.

A headline (breaks apart from appends), a table per cause, the fixes with the turns they hit, and
the top breaks with a short diff each in a fenced block. Client text never escapes its place: table
cells have their pipes and newlines escaped, and each code fence is longer than any run of
backticks inside it.
"""

from __future__ import annotations

import re
from typing import Any

from analyzer import report_view as rv
from analyzer.results import Report
from prefixtrace.common.words import plural
from recorder.redact import DEFAULT_REDACTOR

DIFF_CONTEXT = 40  # chars kept either side of the differing span
DIFF_SPAN = 160  # most chars of the differing span shown
REDACT_MARGIN = 512  # chars beyond each cut redacted with it: longer than any secret format but a PEM body


def _cell(text: Any) -> str:
    """Table-cell safe: no pipe, newline or backtick run can break the row."""
    return re.sub(r"\s+", " ", str(text)).replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").strip()


def _fence(text: str) -> str:
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    return "`" * max(3, longest + 1)


def _short(text: str, start: int, end: int) -> str:
    """The differing span with a little context, on one side of the diff. Each piece is redacted with
    a margin beyond what is shown, before it is cut: a secret that straddles the cut becomes
    `[REDACTED]` as a whole instead of showing a tail no pattern would match."""
    margin = REDACT_MARGIN
    lo = max(0, start - DIFF_CONTEXT)
    head = DEFAULT_REDACTOR.text(text[max(0, lo - margin):start])
    head = head[-(start - lo):] if start > lo else ""
    span = DEFAULT_REDACTOR.text(text[start:end])
    if len(span) > DIFF_SPAN:
        span = span[:DIFF_SPAN] + "…"
    tail = DEFAULT_REDACTOR.text(text[end:end + DIFF_CONTEXT + margin])[:DIFF_CONTEXT]
    return ("…" if lo else "") + head + span + tail + ("…" if end + DIFF_CONTEXT < len(text) else "")


def diff_block(diff: tuple[str, str, int, int, int]) -> str:
    before, after, start, bend, aend = diff
    lines = [f"- {line}" for line in _short(before, start, bend).splitlines() or [""]]
    lines += [f"+ {line}" for line in _short(after, start, aend).splitlines() or [""]]
    body = "\n".join(lines)
    fence = _fence(body)
    return f"{fence}diff\n{body}\n{fence}"


def _cost(seconds, tokens) -> str:
    return (f"{rv.seconds_text(seconds)}, " if seconds is not None else "") + f"{tokens or 0:,} tokens"


def render(d: dict[str, Any], top_n: int = 5) -> str:
    v = rv.build(d, top_n=top_n)
    h = v["headline"]
    out = ["## prefixtrace: prompt cache breaks", ""]
    out += [f"> **warning:** {_cell(w)}" for w in d.get("warnings") or []]
    if h["breaks"]:
        secs = f"**{rv.seconds_text(h['lost_seconds'])}** and " if h["lost_seconds"] is not None else ""
        usd = f" ({rv.dollars_text(h['lost_dollars'])})" if h.get("lost_dollars") is not None else ""
        out.append(f"**{h['breaks']:,} cache break{'s' * (h['breaks'] != 1)}** cost {secs}"
                   f"**{h['lost_tokens']:,} re-prefilled tokens**{usd}.")
    else:
        out.append("**No cache break**: every turn only appended to the previous prompt.")
    out += ["", f"Besides, {h['appended_tokens']:,} new tokens were appended (no cache could have served them). "
                f"{plural(h['turns'], 'turn')} in {plural(h['sessions'], 'session')}; renderer `{_cell(d.get('renderer'))}`, "
                f"tokenizer `{_cell(d.get('tokenizer'))}`."
            + (f" {_cell(d['renderer_note'])}" if d.get("renderer_note") else ""), ""]
    if v["by_cause"]:
        out += ["| cause | breaks | seconds lost | tokens re-prefilled |", "|---|--:|--:|--:|"]
        for c in v["by_cause"]:
            secs = rv.seconds_text(c["lost_seconds"]) if c["lost_seconds"] is not None else "–"
            out.append(f"| {_cell(c['label'])} (`{c['cause']}`) | {c['breaks']:,} | {secs} | {c['lost_tokens']:,} |")
        out.append("")
    if v["groups"]:
        out += ["### What to fix", ""]
        for g in v["groups"]:
            turns = ", ".join(f"{b['number']:,}" for b in g["breaks"][:30]) + (" …" if len(g["breaks"]) > 30 else "")
            out.append(f"- **{_cell(g['label'])}** (`{g['kind']}`): {plural(len(g['breaks']), 'break')}, "
                       f"{_cost(g['lost_seconds'], g['lost_tokens'])}; turns {turns}")
            if g["fix"]:
                out.append(f"  - fix: {_cell(g['fix'])}")
            if g["values"]:
                more = " …" if len(g["breaks"]) > len(g["values"]) else ""
                out.append(f"  - values seen: {_cell(', '.join(g['values']))}{more}")
        out.append("")
    if v["top"]:
        out += [f"### Top {len(v['top'])} breaks by cost", ""]
        for i, b in enumerate(v["top"], 1):
            s = v["sessions"][b["session_index"]]
            out += [f"{i}. **{_cost(b['lost_seconds'], b['lost_tokens'])}**: turn {b['number']:,} of "
                    f"{_cell(rv.session_name(s))}, {_cell(b['label'])} at {_cell(b['where'])}", ""]
            if b["fix"]:
                out += [f"   Fix: {_cell(b['fix'])}", ""]
            out += ["   " + line if line else "" for line in diff_block(b["diff"]).splitlines()]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def to_markdown(report: Report) -> str:
    return render(report.to_dict())

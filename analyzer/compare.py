"""Two analyses side by side (`prefixtrace compare`, docs/ANALYZER.md "Comparing recordings").

Each side is a set of turns: a whole report (two recordings, two transcript sets) or one report's turns
grouped by the harness's version, the harness, or the model. Per side: the hit rate (the share of the
prompt tokens the analysis predicts a prefix cache serves; beside it the server's own share where every
turn reported its cached tokens), the miss rate (turns with a break, over the turns that had a previous one), the
misses per cause and per what opened the turn, and the seconds and dollars the breaks lost. The
deltas are each side against the one before it; `regressions` lists every miss rate that rose by more
than a threshold (in percentage points), which is what makes `compare` a CI gate.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from analyzer.turn_kinds import miss_rates

BY = ("version", "harness", "model")


@dataclass
class Side:
    name: str
    turns: list = field(default_factory=list)

    def metrics(self) -> dict[str, Any]:
        turns = [t for t in self.turns if t.prompt_tokens is not None]
        chained = [t for t in turns if t.note != "first" and not t.note.startswith("unrenderable")]
        prompt = sum(t.prompt_tokens for t in turns)
        predicted = sum(t.predicted_cached_tokens or 0 for t in turns)
        reported = bool(turns) and all(t.reported_cached_tokens is not None for t in turns)
        served = sum(t.reported_cached_tokens for t in turns) if reported else None
        served_of = sum(t.reported_prompt_tokens or t.prompt_tokens for t in turns) if reported else None
        misses = [t for t in chained if t.brk is not None]
        causes: dict[str, int] = {}
        for t in misses:
            causes[t.brk.cause] = causes.get(t.brk.cause, 0) + 1
        seconds = [t.lost_seconds for t in misses if t.lost_seconds is not None]
        dollars = [t.lost_dollars for t in misses if t.lost_dollars is not None]
        return {
            "name": self.name, "turns": len(turns), "prompt_tokens": prompt,
            "hit_rate": round(predicted / prompt, 4) if prompt else None,  # the same basis for any input
            "reported_hit_rate": round(served / served_of, 4) if served_of else None,  # every turn reported
            "misses": len(misses), "miss_rate": _rate(len(misses), len(chained)),
            "by_cause": {c: {"misses": n, "miss_rate": _rate(n, len(chained))}
                         for c, n in sorted(causes.items(), key=lambda kv: -kv[1])},
            "by_kind": {k: {"misses": r["misses"], "turns": r["turns"], "miss_rate": r["miss_rate"]}
                        for k, r in miss_rates(turns).items() if k != "first"},
            "lost_tokens": sum(t.lost_tokens or 0 for t in misses),
            "lost_seconds": round(sum(seconds), 2) if seconds else None,
            "lost_dollars": round(sum(dollars), 6) if dollars else None,
        }


def _rate(n: int, d: int) -> float | None:
    return round(n / d, 4) if d else None


def _version_key(name: str) -> tuple:
    """"claude-code 2.1.10" after "claude-code 2.1.9": numbers compare as numbers."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[.\s+-]", name))


def group(report, by: str) -> list[Side]:
    """One report's turns grouped by `by` ("version", "harness", "model"), in version/name order."""
    if by not in BY:
        from prefixtrace.common.errors import InvalidRequest

        raise InvalidRequest(f"--by must be one of {', '.join(BY)}, got {by!r}")
    sides: dict[str, Side] = {}
    for s in report.sessions:
        for t in s.turns:
            if by == "version":
                key = f"{t.harness or 'unknown'} {t.harness_version or 'unknown'}"
            elif by == "harness":
                key = t.harness or "unknown"
            else:
                key = t.model or "unknown"
            sides.setdefault(key, Side(key)).turns.append(t)
    return [sides[k] for k in sorted(sides, key=_version_key)]


def sides_of(reports: Iterable[tuple[str, Any]]) -> list[Side]:
    return [Side(name, [t for s in r.sessions for t in s.turns]) for name, r in reports]


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 4)


def comparison(sides: list[Side], max_regression: float | None = None) -> dict[str, Any]:
    """Every side's metrics, each side's deltas against the one before, and the regressions: a miss
    rate (overall, per cause, per turn kind) that rose by more than `max_regression` percentage points."""
    rows = [s.metrics() for s in sides]
    deltas, regressions = [], []
    for a, b in zip(rows, rows[1:]):
        d = {"from": a["name"], "to": b["name"], "hit_rate": _delta(a["hit_rate"], b["hit_rate"]),
             "miss_rate": _delta(a["miss_rate"], b["miss_rate"]),
             "lost_tokens": b["lost_tokens"] - a["lost_tokens"],
             "lost_seconds": _delta(a["lost_seconds"] or 0.0, b["lost_seconds"] or 0.0),
             "lost_dollars": _delta(a["lost_dollars"], b["lost_dollars"]),
             "by_cause": {c: _delta((a["by_cause"].get(c) or {}).get("miss_rate") or 0.0,
                                    (b["by_cause"].get(c) or {}).get("miss_rate") or 0.0)
                          for c in {**a["by_cause"], **b["by_cause"]}},
             "by_kind": {k: _delta((a["by_kind"].get(k) or {}).get("miss_rate"), (b["by_kind"].get(k) or {}).get("miss_rate"))
                         for k in {**a["by_kind"], **b["by_kind"]}}}
        deltas.append(d)
        if max_regression is not None:
            limit = max_regression / 100
            checks = [("miss rate", d["miss_rate"])] + [(f"{c} miss rate", v) for c, v in d["by_cause"].items()] + \
                     [(f"miss rate of {k} turns", v) for k, v in d["by_kind"].items()]
            regressions += [{"from": a["name"], "to": b["name"], "what": what, "rise_points": round(v * 100, 2)}
                            for what, v in checks if v is not None and v > limit]
    return {"sides": rows, "deltas": deltas, "max_regression": max_regression, "regressions": regressions}


# --- output -----------------------------------------------------------------------------------------------

def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v * 100:.1f} %"


def _pts(v: float | None) -> str:
    return "" if v is None else f"{v * 100:+.1f} pts"


def _money(v: float | None) -> str:
    return "—" if v is None else f"${v:,.4f}"


def _table(c: dict) -> tuple[list[str], list[list[str]]]:
    """The comparison as rows of cells: one column per side, then the last pair's delta."""
    sides, last = c["sides"], (c["deltas"][-1] if c["deltas"] else None)
    head = ["", *[s["name"] for s in sides]] + (["Δ (last two)"] if last else [])
    rows = [["turns", *[f"{s['turns']:,}" for s in sides]] + ([""] if last else []),
            ["hit rate (predicted)", *[_pct(s["hit_rate"]) for s in sides]] + ([_pts(last["hit_rate"])] if last else []),
            ["hit rate (server)", *[_pct(s["reported_hit_rate"]) for s in sides]]
            + ([_pts(_delta(sides[-2]["reported_hit_rate"], sides[-1]["reported_hit_rate"]))] if last else []),
            ["miss rate", *[_pct(s["miss_rate"]) for s in sides]] + ([_pts(last["miss_rate"])] if last else [])]
    for cause in sorted({c for s in sides for c in s["by_cause"]}):
        rows.append([f"  {cause}", *[f"{(s['by_cause'].get(cause) or {}).get('misses', 0)} "
                                     f"({_pct((s['by_cause'].get(cause) or {}).get('miss_rate') or 0.0)})" for s in sides]]
                    + ([_pts(last["by_cause"].get(cause))] if last else []))
    for kind in sorted({k for s in sides for k in s["by_kind"]}):
        rows.append([f"  opened by {kind}", *[f"{(s['by_kind'].get(kind) or {}).get('misses', 0)}/"
                                              f"{(s['by_kind'].get(kind) or {}).get('turns', 0)} "
                                              f"({_pct((s['by_kind'].get(kind) or {}).get('miss_rate'))})" for s in sides]]
                    + ([_pts(last["by_kind"].get(kind))] if last else []))
    rows.append(["lost tokens", *[f"{s['lost_tokens']:,}" for s in sides]] + ([f"{last['lost_tokens']:+,}"] if last else []))
    rows.append(["lost seconds", *["—" if s["lost_seconds"] is None else f"{s['lost_seconds']:,.2f} s" for s in sides]]
                + ([f"{last['lost_seconds']:+,.2f} s" if last and last["lost_seconds"] is not None else ""] if last else []))
    rows.append(["lost dollars", *[_money(s["lost_dollars"]) for s in sides]]
                + ([f"{last['lost_dollars']:+,.4f}" if last and last["lost_dollars"] is not None else ""] if last else []))
    return head, rows


def _verdict(c: dict) -> list[str]:
    if c["max_regression"] is None:
        return []
    if not c["regressions"]:
        return [f"no miss rate rose by more than {c['max_regression']:g} points"]
    return [f"REGRESSION: {r['what']} rose {r['rise_points']:+.1f} points from {r['from']} to {r['to']} "
            f"(over {c['max_regression']:g})" for r in c["regressions"]]


def to_text(c: dict) -> str:
    head, rows = _table(c)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda cells: "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(head), *map(line, rows), *_verdict(c)]) + "\n"


def to_markdown(c: dict) -> str:
    head, rows = _table(c)
    esc = lambda x: x.replace("|", "\\|")  # noqa: E731
    out = ["| " + " | ".join(map(esc, head)) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(esc(x.strip()) if i == 0 else esc(x) for i, x in enumerate(r)) + " |" for r in rows]
    verdict = _verdict(c)
    return "\n".join(out + ([""] + [f"**{v}**" if v.startswith("REGRESSION") else v for v in verdict] if verdict else [])) + "\n"


def to_html(c: dict) -> str:
    head, rows = _table(c)
    cells = lambda r, tag: "".join(f"<{tag}>{html.escape(x)}</{tag}>" for x in r)  # noqa: E731
    verdict = "".join(f"<p class=\"{'bad' if v.startswith('REGRESSION') else 'ok'}\">{html.escape(v)}</p>"
                      for v in _verdict(c))
    return ("<!doctype html><meta charset=\"utf-8\"><title>prefixtrace compare</title><style>"
            "body{font:14px system-ui,sans-serif;margin:24px;color:#1f2933}table{border-collapse:collapse}"
            "td,th{padding:4px 10px;border-bottom:1px solid #e4e7eb;text-align:right}td:first-child,th:first-child"
            "{text-align:left}.bad{color:#c62828;font-weight:600}.ok{color:#2e7d32}</style>"
            f"<h1>prefixtrace compare</h1><table><tr>{cells(head, 'th')}</tr>"
            + "".join(f"<tr>{cells(r, 'td')}</tr>" for r in rows) + f"</table>{verdict}")


def to_json(c: dict) -> str:
    return json.dumps(c, indent=2, ensure_ascii=False) + "\n"


FORMATS = {"text": to_text, "json": to_json, "markdown": to_markdown, "html": to_html}

"""`prefixtrace replay SRC --target URL --fix NAME[,...]`: a fix proven by a paired replay (docs/FIXES.md).

Each recorded session is sent twice to one server, as recorded and as fixed (the fixes applied as
`serve --fix` would have, each session with its own record fed by the recorded replies). The two
variants alternate which goes first, session by session, so neither always meets the cache the other
warmed. Per variant: cached and prompt tokens, hit rate, TTFT, seconds, dollars (with a price model);
side by side: the breaks the fix removed and those it caused (a later turn whose cached tokens fall
below `BREAK_SHARE` of the previous turn's prompt), savings as gain minus busts, a verdict against
`--min-gain` (hit-rate points, fixed before the run), and what the fix did not improve.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import httpx

from analyzer.fixes.sessions import FixSessions
from prefixtrace.common.errors import InvalidRequest
from prefixtrace.common.escaping import xml_text
from prefixtrace.common.urls import credentials, display_url, without_credentials
from recorder.replay import group_sessions, normalize_base_url, replay_turn  # the replay's own URL rule
from recorder.turn import Turn

BREAK_SHARE = 0.9  # a later turn that reuses less than this share of the previous prompt broke the prefix
VARIANTS = ("recorded", "fixed")


def fixed_sessions(names: list[str], sessions: list[list[Turn]]) -> tuple[list[list[Turn] | None], Counter, Counter]:
    """Each session's turns with the fixes applied in order (None for a session no fix changed: its
    fixed variant is the recorded one), and per fix how often it fired and why it stood aside."""
    fired, aside = Counter(), Counter()
    out: list[list[Turn] | None] = []
    for session in sessions:
        fixes = FixSessions(names)  # one record per session, as the proxy keeps
        turns, changed = [], False
        for turn in session:
            applied = fixes.apply(turn.endpoint, turn.request_body, turn.session_id)
            for entry in applied.entries if applied else []:
                if entry["fired"]:
                    fired[entry["name"]] += 1
                else:
                    aside[(entry["name"], entry["note"])] += 1
            changed = changed or bool(applied and applied.fired)
            body = applied.body if applied is not None else turn.request_body
            turns.append(dataclasses.replace(turn, request_body=body))
            fixes.learn(turn.session_id, turn.response_text, turn.reasoning_text, turn.tool_calls)
        out.append(turns if changed else None)
    return out, fired, aside


def breaks_of(turns: list[dict]) -> set[tuple[Any, int]]:
    """(session, index) of each later turn whose cached tokens fell below `BREAK_SHARE` of the
    previous turn's prompt: the server could not reuse the prefix it had just seen."""
    found = set()
    for prev, turn in zip(turns, turns[1:]):
        if prev["session"] != turn["session"] or prev["prompt_tokens"] is None or turn["cached_tokens"] is None:
            continue
        if turn["cached_tokens"] < BREAK_SHARE * prev["prompt_tokens"]:
            found.add((turn["session"], turn["index"]))
    return found


def _summary(turns: list[dict], sheet) -> dict[str, Any]:
    ok = [t for t in turns if 200 <= t["status"] < 300 and not t.get("error")]
    later = [t for t in ok if t["index"] > 0]
    prompt = sum(t["prompt_tokens"] or 0 for t in ok)
    cached = sum(t["cached_tokens"] or 0 for t in ok)
    later_prompt = sum(t["prompt_tokens"] or 0 for t in later)
    ttfts = [t["ttft_ms"] for t in ok if t["ttft_ms"] is not None]
    out = {"turns": len(turns), "ok_turns": len(ok), "prompt_tokens": prompt, "cached_tokens": cached,
           "hit_rate": round(cached / prompt, 4) if prompt else None,
           "hit_rate_later_turns": round(sum(t["cached_tokens"] or 0 for t in later) / later_prompt, 4)
           if later_prompt else None,
           "median_ttft_ms": round(statistics.median(ttfts), 2) if ttfts else None,
           "seconds": round(sum(t["total_ms"] for t in ok) / 1000, 3),
           "cached_reported": any(t["cached_tokens"] is not None for t in ok)}
    if sheet is not None:
        out["dollars"] = round(sum(sheet.prompt_dollars(t["prompt_tokens"] or 0, t["cached_tokens"] or 0) for t in ok), 6)
    return out


async def _play(url: str, order: list[tuple[str, list[Turn]]], model: str | None, timeout: float,
                progress: Callable[[], None] | None) -> dict[str, list[dict]]:
    real = normalize_base_url(url)
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}  # "both": one sending, in both lists
    async with httpx.AsyncClient(base_url=without_credentials(real), auth=credentials(real),
                                 timeout=httpx.Timeout(timeout, connect=10.0)) as client:
        for variant, session in order:
            for index, turn in enumerate(session):
                result = (await replay_turn(client, turn, index, model)).to_dict()
                for name in (VARIANTS if variant == "both" else (variant,)):
                    results[name].append(result)
                if progress:
                    progress()
    return results


def paired_replay(turns: list[Turn], target: str, names: list[str], *, min_gain: float = 0.05,
                  model: str | None = None, timeout: float = 600.0, price_model: str | None = None,
                  progress: Callable[[], None] | None = None) -> dict[str, Any]:
    """Replays every session as recorded and as fixed against `target`; the report described above."""
    if not names:
        raise InvalidRequest("a paired replay needs at least one fix (--fix NAME)")
    sheet = None
    if price_model:
        from analyzer.pricing import price_sheet

        sheet = price_sheet(price_model)
    recorded = group_sessions(turns)
    fixed, fired, aside = fixed_sessions(names, recorded)
    order: list[tuple[str, list[Turn]]] = []
    for k, (a, b) in enumerate(zip(recorded, fixed)):
        if b is None:  # sent once: the same requests again would only meet their own warm cache
            order.append(("both", a))
            continue
        pair = [("recorded", a), ("fixed", b)]
        order += pair if k % 2 == 0 else pair[::-1]  # alternate who meets the colder server
    results = asyncio.run(_play(target, order, model, timeout, progress))
    before, after = breaks_of(results["recorded"]), breaks_of(results["fixed"])
    by_key = {v: {(t["session"], t["index"]): t for t in results[v]} for v in VARIANTS}
    removed, caused = sorted(before - after, key=str), sorted(after - before, key=str)
    gain = sum((by_key["fixed"][k]["cached_tokens"] or 0) - (by_key["recorded"][k]["cached_tokens"] or 0)
               for k in removed)
    busts = sum((by_key["recorded"][k]["cached_tokens"] or 0) - (by_key["fixed"][k]["cached_tokens"] or 0)
                for k in caused)
    summaries = {v: _summary(results[v], sheet) for v in VARIANTS}
    rec, fix = summaries["recorded"], summaries["fixed"]
    # The verdict reads turns 2 and later: a session's first turn in the variant sent second meets the
    # cache the first variant warmed with the same request (alternating evens that out over sessions,
    # not within one), while a later turn's reuse is the session's own prefix.
    key = "hit_rate_later_turns" if rec["hit_rate_later_turns"] is not None else "hit_rate"
    hit_gain = None if rec[key] is None or fix[key] is None else round(fix[key] - rec[key], 4)
    side = {"hit_rate_gain": hit_gain, "cached_tokens_gain": fix["cached_tokens"] - rec["cached_tokens"],
            "seconds_saved": round(rec["seconds"] - fix["seconds"], 3),
            "ttft_ratio": round(fix["median_ttft_ms"] / rec["median_ttft_ms"], 3)
            if fix["median_ttft_ms"] and rec["median_ttft_ms"] else None,
            "breaks_removed": len(removed), "breaks_caused": len(caused),
            "gain_tokens": gain, "bust_tokens": busts, "savings_tokens": gain - busts}
    if sheet is not None:
        side["dollars_saved"] = round(rec["dollars"] - fix["dollars"], 6)
    if not fired:
        verdict = "no verdict: no fix fired on this recording, so there was nothing for it to gain"
    elif not rec["cached_reported"]:
        verdict = "no verdict: the target reports no cached tokens"
    elif hit_gain is not None and hit_gain >= min_gain:
        verdict = f"pass: hit rate of turns 2+ +{hit_gain * 100:.1f} points (at least {min_gain * 100:.1f} asked)"
    else:
        verdict = f"fail: hit rate of turns 2+ {(hit_gain or 0) * 100:+.1f} points (at least {min_gain * 100:.1f} asked)"
    still = sorted(after & before, key=str)
    not_improved = [f"{len(still)} turn(s) break with the fix as without it: " +
                    ", ".join(f"session {s} turn {i + 1}" for s, i in still[:10]) if still else
                    "every turn that broke without the fix reused its prefix with it"]
    not_improved += [f"--fix {n} stood aside {k} time(s): {note}" for (n, note), k in sorted(aside.items())
                     if n not in fired]
    not_improved.append("output tokens and decoding: a fix changes the prompt only")
    return {"target": display_url(normalize_base_url(target)), "fixes": names, "min_gain": min_gain,
            "break_share": BREAK_SHARE, "fired": dict(fired), "variants": summaries, "side_by_side": side,
            "removed": [list(k) for k in removed], "caused": [list(k) for k in caused], "verdict": verdict,
            "not_improved": not_improved, "turns": results}


def _pct(v: float | None) -> str:
    return "?" if v is None else f"{v * 100:.1f} %"


def _rows(report: dict) -> list[tuple[str, str, str]]:
    rec, fix = report["variants"]["recorded"], report["variants"]["fixed"]
    rows = [("turns answered", f"{rec['ok_turns']}/{rec['turns']}", f"{fix['ok_turns']}/{fix['turns']}"),
            ("prompt tokens", f"{rec['prompt_tokens']:,}", f"{fix['prompt_tokens']:,}"),
            ("cached tokens", f"{rec['cached_tokens']:,}", f"{fix['cached_tokens']:,}"),
            ("hit rate", _pct(rec["hit_rate"]), _pct(fix["hit_rate"])),
            ("hit rate, turns 2+", _pct(rec["hit_rate_later_turns"]), _pct(fix["hit_rate_later_turns"])),
            ("median TTFT ms", str(rec["median_ttft_ms"]), str(fix["median_ttft_ms"])),
            ("seconds", f"{rec['seconds']:.2f}", f"{fix['seconds']:.2f}")]
    if "dollars" in rec:
        rows.append(("dollars", f"${rec['dollars']:.4f}", f"${fix['dollars']:.4f}"))
    return rows


def format_paired(report: dict) -> str:
    side = report["side_by_side"]
    lines = [f"paired replay against {report['target']}: --fix {','.join(report['fixes'])} "
             f"(fired {sum(report['fired'].values())} time(s))", "", f"{'':24}{'recorded':>16}{'fixed':>16}"]
    lines += [f"{name:24}{a:>16}{b:>16}" for name, a, b in _rows(report)]
    lines += ["", f"breaks removed {side['breaks_removed']}, caused {side['breaks_caused']}; savings "
              f"{side['savings_tokens']:,} tokens (gain {side['gain_tokens']:,} minus busts {side['bust_tokens']:,}); "
              f"{side['seconds_saved']:+.2f} s" + (f", ${side['dollars_saved']:+.4f}" if "dollars_saved" in side else ""),
              f"verdict: {report['verdict']}", "what the fix does not improve:"]
    lines += [f"  - {line}" for line in report["not_improved"]]
    return "\n".join(lines)


def render_paired_html(report: dict) -> str:
    rows = "".join(f"<tr><th>{xml_text(n)}</th><td>{xml_text(a)}</td><td>{xml_text(b)}</td></tr>" for n, a, b in _rows(report))
    items = "".join(f"<li>{xml_text(line)}</li>" for line in report["not_improved"])
    text = xml_text(format_paired(report).split("\n\n")[-1].split("\n")[0])
    return ("<!doctype html><meta charset=utf-8><title>prefixtrace paired replay</title>"
            "<style>body{font:15px system-ui;margin:2em;max-width:60em}table{border-collapse:collapse}"
            "td,th{padding:.3em 1em;border-bottom:1px solid #ddd;text-align:right}th{text-align:left}</style>"
            f"<h1>Paired replay: --fix {xml_text(','.join(report['fixes']))}</h1>"
            f"<p>against {xml_text(report['target'])}; each session sent as recorded and as fixed, alternating.</p>"
            f"<p><strong>{xml_text(report['verdict'])}</strong></p>"
            f"<table><tr><th></th><th>recorded</th><th>fixed</th></tr>{rows}</table><p>{text}</p>"
            f"<h2>What the fix does not improve</h2><ul>{items}</ul>"
            f"<script type=application/json id=report>{json.dumps(report).replace('<', chr(92) + 'u003c')}</script>")


def write_paired(report: dict, path: str | Path) -> None:
    path = Path(path)
    path.write_text(render_paired_html(report) if path.suffix.lower() in (".html", ".htm")
                    else json.dumps(report, indent=2))

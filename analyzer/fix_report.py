"""The fixes in an analysis (docs/FIXES.md): which ones `serve --fix` applied to the recorded turns, and,
for each cause found, the fix that addresses it with what it would have saved.

The proposal is measured, never estimated: the fix is applied to the recorded requests in order (each
session with its own record, as the proxy would have), the fixed requests are analysed again with the
same renderer and tokenizer, and the saving is the difference in lost tokens, seconds and dollars; a
break the fix introduces counts against it (savings = gain minus busts).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any, Callable

from analyzer.fixes import FIXES
from analyzer.fixes.sessions import FixSessions
from analyzer.load import Request
from analyzer.results import Break, Report
from prefixtrace.common.words import plural

# Which breaks each fix addresses. breakpoints and session-key change no prompt text: an offline
# analysis cannot see what they save (`replay --fix` measures them against a server).
ADDRESSES: dict[str, Callable[[Break], bool]] = {
    "volatile": lambda b: (b.subtype or "").startswith("volatile"),
    "tool-order": lambda b: b.cause == "tools_change" or (b.cause == "serialization" and b.tool_index is not None),
    "tool-args": lambda b: b.cause in ("serialization", "history_edit") and b.tool_index is None
    and any(k in (b.path or "") for k in ("tool_calls", "arguments", "input")),
    "thinking": lambda b: b.cause == "thinking_strip" or (b.cause == "history_edit" and "reasoning" in (b.path or "")),
    "breakpoints": lambda b: b.cause == "server_miss",
    "session-key": lambda b: b.cause == "server_miss",
}
OFFLINE_BLIND = ("breakpoints", "session-key")
_COUNTS = re.compile(r"\s+\(\d.*\)$")  # "(1 value(s))", "(2 moved, 0 re-spelled)"


def proxy_fix_summary(requests: list[Request]) -> list[dict]:
    """[{"name", "note", "turns"}]: the fixes that fired on recorded turns, their notes without counts."""
    seen: Counter = Counter()
    for req in requests:
        for entry in req.proxy_fixes or []:
            seen[(entry["name"], _COUNTS.sub("", entry["note"]))] += 1
    return [{"name": n, "note": note, "turns": k} for (n, note), k in sorted(seen.items())]


REASONING_PROBE = "prefixtrace-reasoning-probe"


def renders_earlier_reasoning(renderer) -> bool | None:
    """Whether `renderer` (the analysis's chat template) renders an earlier tool-loop turn's reasoning,
    found by rendering one; None when it cannot render that shape."""
    body = {"messages": [{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "", "reasoning_content": REASONING_PROBE, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "r"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]}
    try:
        return REASONING_PROBE in "".join(renderer.render(body).segments)
    except Exception:  # a template that refuses this shape: not known
        return None


def fixed_requests(names: list[str], requests: list[Request],
                   keeps_reasoning: bool | None = None) -> tuple[list[Request], int]:
    """The requests with the named fixes applied as the proxy would have (in time order, one record
    per session, fed with the recorded replies), and how many were changed."""
    sessions = FixSessions(names, template_keeps_reasoning=keeps_reasoning)
    out, changed = [], 0
    for req in sorted(requests, key=lambda r: r.ts):
        applied = sessions.apply(req.endpoint or "/v1/chat/completions", req.body, req.session)
        if applied is not None and applied.fired:
            changed += 1
            req = dataclasses.replace(req, body=applied.body)
        if req.reply:  # what the model answered, for tool-args and thinking on the session's later requests
            sessions.learn(req.session, req.reply["text"], req.reply["reasoning"], req.reply["tool_calls"])
        out.append(req)
    return out, changed


def _lost(report: Report) -> tuple[int, float | None, float | None]:
    tokens, seconds, dollars = 0, None, None
    for _, t in report.breaks:
        tokens += t.lost_tokens or 0
        if t.lost_seconds is not None:
            seconds = (seconds or 0.0) + t.lost_seconds
        if getattr(t, "lost_dollars", None) is not None:
            dollars = (dollars or 0.0) + t.lost_dollars
    return tokens, seconds, dollars


def _diff(a: float | None, b: float | None, digits: int) -> float | None:
    return None if a is None and b is None else round((a or 0.0) - (b or 0.0), digits)


def predicted_only(requests: list[Request]) -> list[Request]:
    """The requests without what the server reported (cached and prompt counts, usage): a fixed prompt
    was never sent, so both sides of a proposal are the analyzer's prediction, compared alike."""
    return [dataclasses.replace(r, reported_prompt_tokens=None, reported_cached_tokens=None, usage=None,
                                cache_miss_reason=None) for r in requests]


def propose_fixes(report: Report, requests: list[Request], reanalyse: Callable[[list[Request]], Report],
                  keeps_reasoning: bool | None = None) -> list[dict]:
    """For each fix whose cause is among the report's breaks: what applying it would have saved, from
    `reanalyse` (the same analysis that made `report`) of the fixed requests against the requests as
    recorded, both predicted without the server's counts. Only the sessions holding such a break are
    analysed again (a fix changes nothing the other sessions' breaks depend on, and a recording's
    analysis is its costliest step)."""
    proposals = []
    predicted: dict[frozenset, Report] = {}
    for name in FIXES:
        addressed = [(s, t) for s, t in report.breaks if ADDRESSES[name](t.brk)]
        if not addressed:
            continue
        proposal: dict[str, Any] = {"fix": name, "cause": addressed[0][1].brk.cause, "breaks": len(addressed)}
        if name in OFFLINE_BLIND:
            proposal["note"] = "changes no prompt text: prove it against the server with `prefixtrace replay --fix`"
            proposals.append(proposal)
            continue
        sessions = {id(s) for s, _ in addressed}
        ids = frozenset(t.request_id for s in report.sessions if id(s) in sessions for t in s.turns)
        subset = [r for r in requests if r.id in ids]
        if ids not in predicted:
            predicted[ids] = reanalyse(predicted_only(subset))
        before = predicted[ids]
        base_tokens, base_seconds, base_dollars = _lost(before)
        base_breaks = {(s.id, t.number) for s, t in before.breaks}
        fixed, changed = fixed_requests([name], subset, keeps_reasoning)
        after = reanalyse(predicted_only(fixed))
        tokens, seconds, dollars = _lost(after)
        # A break the fix addresses is removed when its turn no longer breaks at all (a turn that still
        # breaks for another reason, e.g. the one request where a ticking value is first learnt, is not).
        targets = {(s.id, t.number) for s, t in before.breaks if ADDRESSES[name](t.brk)}
        after_breaks = {(s.id, t.number) for s, t in after.breaks}
        caused = after_breaks - base_breaks
        proposal.update({
            "requests_changed": changed, "breaks_removed": len(targets - after_breaks), "breaks_caused": len(caused),
            "saved_tokens": base_tokens - tokens, "saved_seconds": _diff(base_seconds, seconds, 2),
            "saved_dollars": _diff(base_dollars, dollars, 6)})
        proposals.append(proposal)
    return proposals


def fix_lines(report: Report) -> list[str]:
    """The text report's lines for both: fixes applied by the proxy, fixes proposed."""
    return lines_for(report.proxy_fixes, report.fix_proposals)


def lines_for(proxy_fixes: list[dict] | None, proposals: list[dict] | None) -> list[str]:
    """`fix_lines` from the report's JSON (`proxy_fixes`, `fix_proposals`)."""
    lines = [f"fixed by the proxy: {f['note']} ({plural(f['turns'], 'turn')})" for f in proxy_fixes or []]
    for p in proposals or []:
        head = f"fix proposed: --fix {p['fix']} for {plural(p['breaks'], p['cause'] + ' break')}"
        if "note" in p:
            lines.append(f"{head}: {p['note']}")
            continue
        saved = f"would have saved {p['saved_tokens']:,} tokens"
        if p.get("saved_seconds") is not None:
            saved += f", {p['saved_seconds']:g} s"
        if p.get("saved_dollars") is not None:
            saved += f", ${p['saved_dollars']:.4f}"
        lines.append(f"{head}: {saved} (breaks removed {p['breaks_removed']}, caused {p['breaks_caused']}; "
                     f"measured by re-analysing the {plural(p['requests_changed'], 'fixed request')})")
    return lines

"""The CI check: every transition is append-only or of an allowed cause.

`check` returns a CheckResult; `assert_prefix_stable` is the same check for
a harness's own test suite (request bodies in, AssertionError out), and
`to_junit` writes one JUnit test case per session for CI dashboards.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from analyzer.analysis import analyze
from analyzer.causes import CAUSES
from analyzer.results import Report, SessionResult, TurnResult
from prefixtrace.common.errors import InvalidRequest
from prefixtrace.common.escaping import xml_text
from prefixtrace.common.words import plural


@dataclass(frozen=True)
class Problem:
    session_id: str
    turn: TurnResult

    def __str__(self) -> str:
        b = self.turn.brk
        head = f"session {self.session_id} turn {self.turn.number} ({self.turn.request_id})"
        if b is None:  # a side request, or unrenderable: the server could not have built this prompt either
            return f"{head}: {self.turn.note}"
        from analyzer.report import _plain, break_lines, cost_text

        lines = break_lines(self.turn, indent="")
        # The first line names the session; the cost comes first after the cause, seconds before tokens.
        first = (f"{head}: {b.cause}{'/' + b.subtype if b.subtype else ''} at {b.location()}: "
                 f"lost {cost_text(self.turn.lost_seconds, self.turn.lost_tokens)}")
        return "\n".join([_plain(first), *lines[1:]])


@dataclass
class CheckResult:
    report: Report
    allow: frozenset[str]
    problems: list[Problem] = field(default_factory=list)
    max_unreadable: str | int | float | None = 0

    @property
    def unreadable(self) -> bool:
        """Not one request could be analysed (empty input, every line unreadable or every request failed):
        nothing was checked, so nothing passes."""
        return self.report.coverage()["analysed"] == 0

    @property
    def too_much_unread(self) -> bool:
        """More of the input than `max_unreadable` (default: any) was skipped or unrenderable."""
        return self.report.too_much_unread(self.max_unreadable)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.too_much_unread

    def summary(self) -> str:
        skipped = "".join(f"\nskipped line {s['line']}: {s['error']}" for s in self.report.skipped)
        cov = self.report.coverage()
        if self.unreadable:
            if cov["input"] == 0:
                return "no request could be read: the input is empty"
            return (f"no request could be read ({cov['skipped_lines']} line(s) skipped, "
                    f"{cov['unrenderable_turns']} unrenderable, {cov['failed_requests']} failed)" + skipped
                    + "".join(f"\n- {p}" for p in self.problems))
        if self.ok:
            n = sum(len(s.turns) for s in self.report.sessions)
            return (f"ok: {plural(n, 'request')}, every transition append-only or allowed "
                    f"({', '.join(sorted(self.allow)) or 'none allowed'})" + skipped)
        if not self.problems:
            return (f"{cov['not_analysed']} of {plural(cov['input'], 'request')} could not be analysed "
                    f"(more than --max-unreadable {self.max_unreadable})" + skipped)
        first = self.problems[0]
        return (f"{plural(len(self.problems), 'transition')} {'breaks' if len(self.problems) == 1 else 'break'} "
                f"the prefix; first: {first}" + skipped)


def parse_allow(allow: str | Iterable[str] | None) -> frozenset[str]:
    if allow is None:
        return frozenset()
    names = [a.strip() for a in (allow.split(",") if isinstance(allow, str) else allow) if a.strip()]
    unknown = [a for a in names if a not in CAUSES]
    if unknown:
        raise InvalidRequest(f"unknown cause(s) {', '.join(unknown)}; known: {', '.join(CAUSES)}")
    return frozenset(names)


FAIL_ON = ("side_request", "server_miss")


def parse_fail_on(fail_on: str | Iterable[str] | None) -> frozenset[str]:
    if fail_on is None:
        return frozenset()
    names = [a.strip() for a in (fail_on.split(",") if isinstance(fail_on, str) else fail_on) if a.strip()]
    unknown = [a for a in names if a not in FAIL_ON]
    if unknown:
        raise InvalidRequest(f"unknown --fail-on value(s) {', '.join(unknown)}; known: {', '.join(FAIL_ON)}")
    return frozenset(names)


def check(source: Any, *, allow: str | Iterable[str] | None = None, max_unreadable: str | int | float | None = 0,
          fail_on: str | Iterable[str] | None = None, **analyze_kwargs: Any) -> CheckResult:
    """Analyses `source` (see `analyze`) and collects the breaks not allowed. Fails too when more than
    `max_unreadable` (a count or "N%"; default 0) of the input could not be read or rendered.
    A side request (a fork of the main chain: title generation, memory extraction, …) is not a break
    of the main chain; with `fail_on="side_request"` each one fails the check too. A `server_miss` (the
    prompt only grew, the server cached less of it) is the server's, not the client's: it fails only with
    `fail_on="server_miss"`."""
    allowed = parse_allow(allow)
    failing = parse_fail_on(fail_on)
    report = analyze(source, **analyze_kwargs)
    report.too_much_unread(max_unreadable)  # a bad threshold is an error before any verdict
    result = CheckResult(report, allowed, max_unreadable=max_unreadable)
    for s in report.sessions:
        if s.parent is not None:  # a side request and its own follow-ups: not the main chain's breaks
            if "side_request" not in failing or not s.turns:
                continue
            result.problems.append(Problem(s.id, s.turns[0]))
        for t in s.turns:
            if t.brk and t.brk.cause == "server_miss" and "server_miss" not in failing:
                continue  # the server lost a prefix the client kept: not the harness's break (--fail-on server_miss)
            if (t.brk and t.brk.cause not in allowed) or t.note.startswith("unrenderable"):
                result.problems.append(Problem(s.id, t))
    return result


def assert_prefix_stable(requests: Iterable[Any], *, allow: str | Iterable[str] | None = None,
                         template: str | Path | None = None, fail_on: str | Iterable[str] | None = "side_request",
                         **analyze_kwargs: Any) -> CheckResult:
    """Raises AssertionError naming the first break that is not allowed.
    `requests` are chat-completions bodies of one conversation, in order: a request that replaces
    both the system prompt and the tools fails as a side request unless `fail_on=None`."""
    from analyzer.load import Request

    # One scripted conversation: one session, never inferred apart.
    items = [r if not isinstance(r, dict) else Request(f"request-{i}", float(i), r, "assert_prefix_stable")
             for i, r in enumerate(requests)]
    result = check(items, allow=allow, template=template, fail_on=fail_on, **analyze_kwargs)
    if not result.ok:
        raise AssertionError(result.summary())
    return result


def _session_case(s: SessionResult, problems: list[Problem]) -> ET.Element:
    # Session ids, roles and diff windows are client text: `xml_text` keeps the file
    # parseable whatever they hold (ElementTree escapes markup, not invalid characters).
    case = ET.Element("testcase", classname="prefixtrace.check", name=xml_text(f"session {s.id}"))
    for p in problems:
        cause = p.turn.brk.cause if p.turn.brk else (
            "side_request" if p.turn.note.startswith("side request") else "unrenderable")
        cost = ""
        if p.turn.brk:
            from analyzer.report import cost_text

            cost = f", lost {cost_text(p.turn.lost_seconds, p.turn.lost_tokens)}"
        failure = ET.SubElement(case, "failure", message=f"turn {p.turn.number}: {cause}{cost}", type=cause)
        failure.text = xml_text(str(p))
    return case


def to_junit(result: CheckResult, path: str | Path) -> None:
    suite = ET.Element("testsuite", name="prefixtrace check", tests=str(len(result.report.sessions)),
                       failures=str(len({p.session_id for p in result.problems})))
    for s in result.report.sessions:
        suite.append(_session_case(s, [p for p in result.problems if p.session_id == s.id]))
    from recorder.files import open_private  # 0600: the report names sessions

    with open_private(path, "wb") as fh:
        ET.ElementTree(suite).write(fh, encoding="utf-8", xml_declaration=True)

"""`to_html(report)`: the HTML report (analyzer/report_html.py builds the page from the report's
dict form; analyzer/report_view.py computes what it shows, shared with the Markdown report)."""

from __future__ import annotations

from analyzer.results import Report
from analyzer.report_html import render
from analyzer.report_view import CACHED, COLOURS

__all__ = ["CACHED", "COLOURS", "to_html"]


def to_html(report: Report, title: str = "prefixtrace analysis") -> str:
    return render(report.to_dict(), title)

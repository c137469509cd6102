"""The analyzer: where each prompt of a session stopped extending the previous one, why, and at what cost."""

from analyzer.analysis import analyze
from analyzer.causes import CAUSES
from analyzer.chains import Analyzer
from analyzer.check import CheckResult, Problem, assert_prefix_stable, check, to_junit
from analyzer.divergence import common_prefix_len, compare
from analyzer.load import Request, load
from analyzer.render import GenericRenderer, Rendered, TemplateRenderer, make_renderer, render_request
from analyzer.report import format_text, to_json
from analyzer.results import Break, Report, SessionResult, TurnResult
from analyzer.tokens import Tokenizer, default_tokenizer, load_tokenizer

__all__ = sorted(
    [
        "Analyzer", "Break", "CAUSES", "CheckResult", "GenericRenderer", "Problem", "Rendered", "Report", "Request",
        "SessionResult", "TemplateRenderer", "Tokenizer", "TurnResult", "analyze", "assert_prefix_stable", "check",
        "common_prefix_len", "compare", "default_tokenizer", "format_text", "load", "load_tokenizer",
        "make_renderer", "render_request", "to_json", "to_junit",
    ]
)

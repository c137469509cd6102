"""The analyzer: where each prompt of a session stopped extending the previous one."""

from analyzer.divergence import Divergence, compare, compare_rendered
from analyzer.render import Rendered, render_request
from analyzer.report import Problem, SessionReport, TurnReport, analyze, check, format_text, load_turns, to_json
from analyzer.sessions import Session, group_sessions
from analyzer.tokens import Tokenizer, default_tokenizer, load_tokenizer

__all__ = sorted(
    [
        "Divergence",
        "Problem",
        "Rendered",
        "Session",
        "SessionReport",
        "Tokenizer",
        "TurnReport",
        "analyze",
        "check",
        "compare",
        "compare_rendered",
        "default_tokenizer",
        "format_text",
        "group_sessions",
        "load_tokenizer",
        "load_turns",
        "render_request",
        "to_json",
    ]
)

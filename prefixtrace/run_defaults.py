"""The serve settings `prefixtrace run` adds when the proxy it starts serves the bundled model.

SmolLM2-135M at its defaults samples until its output limit (2,048 tokens of drift; pi took
408 s) and rarely calls a tool, so a harness's loop never ends. Greedy decoding, a short output
cap, a mild repetition penalty and a forced first tool call are what the harness suite runs it
with (tests/harness/conftest.py ENGINE_ARGS: `run pi` in seconds); the user's own --serve-args win.
"""

from __future__ import annotations

from typing import Sequence

SMALL_MODEL_SETTINGS = (
    ("--default-temperature", "0"),
    ("--default-frequency-penalty", "0.5"),
    ("--default-max-tokens", "128"),
    ("--tool-choice-default", "required-until-tool-result"),
)


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def small_model_args(serve_args: Sequence[str]) -> list[str]:
    """The settings to add to a started serve's `serve_args`: none when it forwards to an upstream
    or serves a model of the user's (--model), and none the user already set."""
    if _given(serve_args, "--upstream") or _given(serve_args, "--model"):
        return []
    return [part for flag, value in SMALL_MODEL_SETTINGS if not _given(serve_args, flag) for part in (flag, value)]

"""Which harness, at which version, sent a request (`harness`, `harness_version` per turn).

From the User-Agent's product token when it names the harness (`claude-cli/2.1.197`, `opencode/1.18.33`,
`QwenCode/0.15.10`, `codex_cli_rs/0.171.0`), the harness's own headers (Codex: `originator` and
`version`), and for a session rebuilt from a transcript, the version its file records (Claude Code's
per-line `version`, Codex's `cli_version`). A harness that sends only its SDK's User-Agent (pi, aider)
is named by analyzer/clients.py and has no version: never guessed from the SDK's.
"""

from __future__ import annotations

import re
from typing import Any

from analyzer.clients import client_of

_PRODUCT = re.compile(r"([A-Za-z][\w.-]*)/(\d[\w.+-]*)")
# The User-Agent product names each harness uses (matched case-insensitively).
_PRODUCTS = {"claude-code": ("claude-cli", "claude-code"), "opencode": ("opencode",), "qwen-code": ("qwencode", "qwen-code"),
             "codex": ("codex_cli_rs", "codex", "codex_exec"), "aider": ("aider",), "llm": ("llm",), "pi": ("pi",)}


def _header(headers: dict | None, name: str) -> str | None:
    return next((str(v) for k, v in (headers or {}).items() if k.lower() == name), None)


def harness_version(headers: dict | None, body: Any, transcript: dict | None = None) -> tuple[str | None, str | None]:
    """(harness, version), either None when it cannot be told."""
    if transcript:
        version = transcript.get("harness_version")
        return transcript.get("harness"), version if isinstance(version, str) else None
    agent = _header(headers, "user-agent")
    harness = client_of(agent, body)
    if harness is None and _header(headers, "originator"):
        harness = "codex"
    version = None
    names = _PRODUCTS.get(harness or "", ())
    for product, number in _PRODUCT.findall(agent or ""):
        if product.lower() in names:
            version = number
            break
    if version is None and harness == "codex":
        version = _header(headers, "version")
    return harness, version

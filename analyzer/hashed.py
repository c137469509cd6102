"""Reading a hash-only recording (`serve --store hashes`, recorder/hashing.py).

Each text was stored as `⟦h:<digest>:<tokens>⟧`. Before the analysis renders it, every marker becomes a
stand-in of about that many tokens that begins with its digest: equal texts stay equal, different ones
part at their first token, and sizes (compaction, cost) stay what they were. What needs the text itself
cannot be told and is said so: the differing characters, a volatile value's kind and values, whether a
change was only re-serialisation.
"""

from __future__ import annotations

from typing import Any

from recorder.hashing import MARKER_RE, STORE_KEY

# Causes whose before / after are not windows of the prompt (values, times, counts): shown as they are.
NOT_PROMPT = frozenset({"param_change", "concurrent", "lookback", "server_miss"})
NOT_KEPT = "(hash-only recording: the text was not kept)"


def _stand_in(match) -> str:
    """About `tokens` tokens (o200k): hex runs take ~0.58 tokens a character (16 hex ≈ 9 tokens), each " ·"
    one; a short text keeps at least 4 hex characters of its digest so that unequal texts stay unequal."""
    digest, tokens = match.group(1), int(match.group(2))
    if tokens > 9:
        return digest + " ·" * (tokens - 9)
    return digest[: min(16, max(4, round(tokens * 1.7)))]


def _expand(value: Any) -> Any:
    if isinstance(value, str):
        return MARKER_RE.sub(_stand_in, value) if "⟦h:" in value else value
    if isinstance(value, dict):
        return {k: _expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v) for v in value]
    return value


def expand(body: Any) -> tuple[Any, bool]:
    """(`body` with its markers as stand-ins, whether it was a hash-only body)."""
    if not isinstance(body, dict) or body.get(STORE_KEY) != "hashes":
        return body, False
    return _expand({k: v for k, v in body.items() if k != STORE_KEY}), True


def blind(report, hashed_ids: set[str]) -> None:
    """What the analysis of hash-only turns cannot tell, said instead of shown."""
    if not hashed_ids:
        return
    from analyzer.advice import suggestion

    for s in report.sessions:
        for t in s.turns:
            b = t.brk
            if t.request_id not in hashed_ids or b is None:
                continue
            if b.volatile or (b.subtype or "").startswith("volatile"):
                b.volatile, b.subtype = None, None
                b.suggestion = suggestion(b.cause, None)
            if b.cause not in NOT_PROMPT:
                b.before = b.after = NOT_KEPT
                b.diff = None
                b.message_char_offset = None
            if b.cause == "serialization":
                b.detail = "hash-only recording: a re-serialised text cannot be told from an edited one"
    report.hashed_note = (f"{len(hashed_ids)} turn(s) recorded with --store hashes: where prompts part and what it "
                          "cost are exact to a few tokens per text; the differing characters, volatile values and "
                          "re-serialisation cannot be told (docs/SECURITY.md 'Hash-only recording')")

"""Recorded traffic as the block-hash traces replay tools load (`prefixtrace export --format mooncake|
agentic-mooncake|weka`, docs/FORMATS.md "Block-hash traces").

No text leaves: each request becomes its input and output lengths and one id per block of its prompt's
tokens, rendered and tokenized as the analysis does. A block's id stands for its tokens *and every token
before it* (a chained hash, as a paged prefix cache keys its blocks), numbered in order of first
appearance, so identical prefixes give identical ids and a replay tool's cache sees the same reuse.

- `mooncake`: Mooncake's trace rows as AIPerf's `mooncake_trace` dataset and Dynamo's `mooncake` format
  read them (one JSON object a line), each request self-contained: `request_id`, `timestamp` (ms since
  the first request), `input_length`, `output_length`, `hash_ids` (the last, partial block included:
  ceil(input_length / block_size) ids).
- `agentic-mooncake`: Dynamo's agentic Mooncake v2 (a header line, then rows with `play_id`, `session_id`,
  `not_before_ms` and typed `dependencies`: each request's parent and wait, analyzer/trace_links.py).
- `weka`: the Weka kv-cache-tester agentic trace AIPerf loads (its `WekaTrace`), one object per session:
  `id`, `models`, `block_size`, `hash_id_scope: "local"`, `requests` of `t` (s since the session's first
  request), `type` ("s" streamed, "n" not), `model`, `in`, `out`, `hash_ids`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from analyzer.chains import Analyzer
from analyzer.load import load
from analyzer.render import make_renderer
from analyzer.server_renderer import choose_renderer
from analyzer.trace_links import links
from prefixtrace.common.errors import InvalidRequest

FORMATS = ("mooncake", "agentic-mooncake", "weka")
AGENTIC_SCHEMA, AGENTIC_VERSION = "dynamo.agentic_mooncake", 2  # Dynamo's AGENTIC_MOONCAKE_SCHEMA, _VERSION
DEFAULT_BLOCK = 512  # AIPerf's and Mooncake's block size


class BlockIds:
    """Chained block hashes numbered by first appearance: equal prefixes, equal ids."""

    def __init__(self, block_size: int):
        if block_size <= 0:
            raise InvalidRequest("--block-size must be positive")
        self.block_size = block_size
        self._ids: dict[bytes, int] = {}

    def of(self, tokens: list[int]) -> list[int]:
        out, prev = [], b""
        for start in range(0, len(tokens), self.block_size):
            block = tokens[start : start + self.block_size]
            digest = hashlib.sha256(prev + b"".join(t.to_bytes(4, "little", signed=True) for t in block)).digest()
            out.append(self._ids.setdefault(digest, len(self._ids)))
            prev = digest
        return out


def _output_length(usage: dict | None) -> int | None:
    if not isinstance(usage, dict):
        return None
    for key in ("completion_tokens", "output_tokens"):
        value = usage.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def turns(source: Any, *, block_size: int = DEFAULT_BLOCK, template=None, model=None, tokenizer=None) -> Iterator[dict]:
    """Per analysed request, in time order: session, time, input/output length, block ids, model."""
    loaded = load(source)
    given = template is not None or model is not None
    choice = choose_renderer(loaded, make_renderer(template, model) if given else None, tokenizer)
    analyzer = Analyzer(choice.renderer, choice.tokenizer, workers=1)
    report = analyzer.run(loaded.requests, loaded.skipped)  # reads every body into the one chat shape
    session_of = {t.request_id: s.id for s in report.sessions for t in s.turns if t.prompt_tokens is not None}
    parent_of = {s.id: s.parent for s in report.sessions}  # a side request's main chain
    ids = BlockIds(block_size)
    for req in sorted((r for r in loaded.requests if r.id in session_of), key=lambda r: r.ts):
        rendered = choice.renderer.render(req.body)
        tokens = list(choice.tokenizer(rendered.text + rendered.generation))
        end = req.ts + req.total_s if req.total_s is not None else None
        yield {"id": req.id, "session": session_of[req.id], "parent_session": parent_of[session_of[req.id]],
               "ts": req.ts, "end": end, "input_length": len(tokens),
               "output_length": _output_length(req.usage), "hash_ids": ids.of(tokens),
               "model": req.body.get("model") if isinstance(req.body.get("model"), str) else None,
               "stream": bool(req.body.get("stream"))}


def mooncake_rows(rows: list[dict]) -> Iterator[dict]:
    """Each request self-contained: its whole prompt's blocks at its recorded time. No `session_id`:
    AIPerf replays rows sharing one as deltas of one conversation (each prompt appended to the previous
    ones and their live replies), which would resend every recorded prompt on top of its predecessors;
    identical ids already make the replay's cache see the session's reuse, and its breaks too."""
    start = min((r["ts"] for r in rows), default=0.0)
    for r in rows:
        row = {"request_id": r["id"], "timestamp": round((r["ts"] - start) * 1000),
               "input_length": r["input_length"], "hash_ids": r["hash_ids"]}
        if r["output_length"] is not None:
            row["output_length"] = r["output_length"]
        yield row


def agentic_mooncake(rows: list[dict], block_size: int) -> Iterator[dict]:
    """Dynamo's agentic Mooncake v2: a header, then one row per request with its typed dependencies."""
    start = min((r["ts"] for r in rows), default=0.0)
    linked = links(rows)
    body = []
    for r in rows:
        row = {"request_id": r["id"], "play_id": r["parent_session"] or r["session"], "session_id": r["session"],
               "model": r["model"] or "unknown", "input_length": r["input_length"],
               "output_length": r["output_length"] or 0, "hash_ids": r["hash_ids"],
               "not_before_ms": round((r["ts"] - start) * 1000, 3)}
        if r["end"] is not None:
            row["recorded_api_time_ms"] = round((r["end"] - r["ts"]) * 1000, 3)
        if r["id"] in linked:
            # As Dynamo's own request-trace lowering does: a dependent request starts from its parent
            # (plus the wait), not at its recorded time, so a faster replay runs the session faster.
            row["dependencies"] = [linked[r["id"]].to_dict()]
            row["not_before_ms"] = 0.0
        body.append(row)
    digest = hashlib.sha256("\n".join(json.dumps(row) for row in body).encode()).hexdigest()
    yield {"schema": AGENTIC_SCHEMA, "version": AGENTIC_VERSION, "block_size": block_size,
           "hash_id_scope": "local", "source": {"format": "prefixtrace", "digest": digest}}
    yield from body


def weka_traces(rows: list[dict], block_size: int) -> Iterator[dict]:
    sessions: dict[str, list[dict]] = {}
    for r in rows:
        sessions.setdefault(r["session"], []).append(r)
    for sid, own in sessions.items():
        start = own[0]["ts"]
        yield {"id": sid, "models": sorted({r["model"] or "unknown" for r in own}), "block_size": block_size,
               "hash_id_scope": "local",  # ids are numbered across the export, so they agree within a trace too
               "requests": [{"t": round(r["ts"] - start, 3), "type": "s" if r["stream"] else "n",
                             "model": r["model"] or "unknown", "in": r["input_length"], "out": r["output_length"] or 0,
                             "hash_ids": r["hash_ids"]} for r in own]}


def export_trace(source: str | Path, out, fmt: str, *, block_size: int = DEFAULT_BLOCK, **render) -> int:
    """Writes `source`'s requests to `out` (a text stream) as `fmt`; returns the number of requests."""
    if fmt not in FORMATS:
        raise InvalidRequest(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    rows = list(turns(source, block_size=block_size, **render))
    if fmt == "mooncake":
        for row in mooncake_rows(rows):
            out.write(json.dumps(row) + "\n")
    elif fmt == "agentic-mooncake":
        for row in agentic_mooncake(rows, block_size):
            out.write(json.dumps(row) + "\n")
    else:
        for trace in weka_traces(rows, block_size):
            out.write(json.dumps(trace) + "\n")
    return len(rows)

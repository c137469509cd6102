"""Import time of a long harness session against its length: the transcript import redacts each
shared message once (recorder/transcripts/store.py `RedactOnce`), and the row writer serialises and
redacts each shared item once (recorder/item_texts.py), so time grows linearly with the calls. The
plain `store_turns` path now shares the second; it is printed beside for comparison. Measured
2026-12-04 on the 2-core VM at load ~15: 250 / 500 / 1,000 / 2,000 calls in 1.3 / 2.3 / 4.7 / 10.8 s
(1,000 calls took 51 s before either).

    python bench/bench_transcript_import.py [CALLS ...]   (default: 250 500 1000)

Prints, per length, both import times side by side and their ratio.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from recorder.jsonl import store_turns  # noqa: E402
from recorder.transcripts import transcript_turns  # noqa: E402
from recorder.transcripts.store import store_transcript_turns  # noqa: E402


def pi_session(path: Path, calls: int) -> None:
    """A pi (version 3) session of `calls` model calls: each reads a file of ~2 KB through a tool."""
    lines = [{"type": "session", "version": 3, "id": "bench", "timestamp": "2026-01-01T00:00:00Z", "cwd": "/w"}]
    parent = None

    def add(entry: dict) -> None:
        nonlocal parent
        entry.update(id=f"e{len(lines)}", parentId=parent)
        parent = entry["id"]
        lines.append(entry)
    add({"type": "message", "message": {"role": "user", "content": [{"type": "text", "text": "go"}]}})
    for i in range(calls):
        add({"type": "message", "message": {"role": "assistant", "api": "openai-completions", "model": "m",
             "content": [{"type": "toolCall", "id": f"c{i}", "name": "read", "arguments": {"path": f"f{i}"}}],
             "usage": {"input": 10 + i, "output": 5, "cacheRead": 0, "cacheWrite": 0}, "stopReason": "toolUse",
             "timestamp": 1767225600000 + i * 1000}})
        add({"type": "message", "message": {"role": "toolResult", "toolCallId": f"c{i}",
             "content": [{"type": "text", "text": f"line {i} of the file " * 100}]}})
    path.write_text("\n".join(json.dumps(o) for o in lines) + "\n")


def timed(store, path: Path, db: Path) -> float:
    start = time.perf_counter()
    turns, _ = transcript_turns(path)
    store(db, turns)
    return time.perf_counter() - start


def main(lengths: list[int]) -> None:
    print(f"{'calls':>6} {'per-message redaction s':>24} {'whole-history redaction s':>26} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in lengths:
            src = Path(tmp) / f"{n}.jsonl"
            pi_session(src, n)
            once = timed(store_transcript_turns, src, Path(tmp) / f"once-{n}.db")
            whole = timed(store_turns, src, Path(tmp) / f"whole-{n}.db")
            print(f"{n:6} {once:24.2f} {whole:26.2f} {whole / once:6.1f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [250, 500, 1000])

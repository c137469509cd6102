"""Importing a long Claude Code or pi session file: peak memory against the file's size.

    python bench/bench_transcript_stream.py --sizes 50,500 [--harness claude-code,pi] [--baseline DIR]

Per harness and size, a session file is written the way long sessions grow, from the real fixture
sessions' lines (fixtures/transcripts/claude/, fixtures/transcripts/pi/) repeated with fresh uuids /
entry ids: user turns of several tool calls, each tool result padded to OUTPUT_BYTES, and a
compaction each time the history passes CONTEXT_BYTES (Claude Code's `compact_boundary` and its
summary message, pi's `compaction` entry), as both compact at their context limit. It is imported
by `prefixtrace import` in a child process (bench/bench_rollout_import.py `import_in_child`), and one
line per size prints the seconds, the child's peak RSS and the database size / file size; with
--baseline, the same import run from another checkout (e.g. one that reads the file whole) beside
it. A last line per harness: the peak RSS of the largest size against the smallest (flat: memory
does not grow with the file).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_rollout_import import import_in_child  # noqa: E402

FIX = ROOT / "fixtures" / "transcripts"
CLAUDE = FIX / "claude" / "efe4eb98-da5c-4c54-8f08-1e2f0925168f.jsonl"
PI = next((FIX / "pi").glob("2026-*.jsonl"))
CONTEXT_BYTES = 1_000_000  # history at which the generated session compacts (~250k tokens)
CALLS_PER_USER_TURN = 8
OUTPUT_BYTES = 6_000  # a tool result: a file read, a test run
WORDS = "def main():\n    value = parse(source)  # lorem ipsum dolor sit amet\n    return value\n"


def _padded(i: int) -> str:
    return f"output {i}\n" + (WORDS * (OUTPUT_BYTES // len(WORDS) + 1))[:OUTPUT_BYTES]


def write_claude_session(path: Path, megabytes: float) -> None:
    """A Claude Code session of `megabytes`, written line by line (never held whole)."""
    lines = [json.loads(line) for line in CLAUDE.read_text().splitlines()]
    prompt = next(o for o in lines if o["type"] == "user" and isinstance(o["message"]["content"], str))
    call = next(o for o in lines if o["type"] == "assistant"
                and any(b.get("type") == "tool_use" for b in o["message"]["content"]))
    result = next(o for o in lines if o["type"] == "user" and "toolUseResult" in o)
    answer = next(o for o in lines if o["type"] == "assistant"
                  and all(b.get("type") == "text" for b in o["message"]["content"]))
    target, history, parent = int(megabytes * 1e6), 0, None
    with open(path, "w") as fh:
        def put(o: dict) -> None:
            nonlocal parent
            o = {**o, "uuid": str(uuid.uuid4()), "parentUuid": parent}
            fh.write(json.dumps(o) + "\n")
            parent = o["uuid"]

        for i in itertools.count():
            if fh.tell() >= target:
                return
            if i % CALLS_PER_USER_TURN == 0:
                put({**prompt, "message": {"role": "user", "content": f"user turn {i}: go on with the refactor"}})
            cid = f"toolu_{i:08d}"
            blocks = [{**b, "id": cid} if b.get("type") == "tool_use" else b for b in call["message"]["content"]]
            put({**call, "message": {**call["message"], "id": f"msg_{i:08d}", "content": blocks}})
            body = _padded(i)
            put({**result, "message": {"role": "user", "content": [
                {"tool_use_id": cid, "type": "tool_result", "content": body}]}, "toolUseResult": {"stdout": body[:500]}})
            history += OUTPUT_BYTES + 800
            if i % CALLS_PER_USER_TURN == CALLS_PER_USER_TURN - 1:
                put({**answer, "message": {**answer["message"], "id": f"msg_{i:08d}_answer"}})
            if history > CONTEXT_BYTES:  # /compact at the context limit: a new chain from the boundary
                logical, parent = parent, None
                put({"type": "system", "subtype": "compact_boundary", "parentUuid": None, "logicalParentUuid": logical,
                     "sessionId": prompt["sessionId"], "version": prompt.get("version"), "timestamp": prompt["timestamp"],
                     "content": "Conversation compacted", "compactMetadata": {"trigger": "auto", "preTokens": 250000}})
                put({**prompt, "isCompactSummary": True, "message": {"role": "user", "content": [
                    {"type": "text", "text": f"This session is being continued from a previous conversation. Summary {i}."}]}})
                history = 0


def write_pi_session(path: Path, megabytes: float) -> None:
    """A pi session (format v3) of `megabytes`, written line by line."""
    lines = [json.loads(line) for line in PI.read_text().splitlines()]
    head = [o for o in lines if o["type"] != "message"]
    user = next(o for o in lines if o.get("message", {}).get("role") == "user")
    call = next(o for o in lines if o.get("message", {}).get("role") == "assistant"
                and any(b.get("type") == "toolCall" for b in o["message"]["content"]))
    result = next(o for o in lines if o.get("message", {}).get("role") == "toolResult")
    answer = next(o for o in lines if o.get("message", {}).get("role") == "assistant" and o is not call)
    target, history, parent, kept = int(megabytes * 1e6), 0, None, None
    with open(path, "w") as fh:
        def put(o: dict) -> str:
            nonlocal parent
            o = {**o, "id": uuid.uuid4().hex[:8] + f"{fh.tell():x}", "parentId": parent}
            fh.write(json.dumps(o) + "\n")
            parent = o["id"]
            return o["id"]

        fh.write(json.dumps(head[0]) + "\n")
        for o in head[1:]:
            put(o)
        for i in itertools.count():
            if fh.tell() >= target:
                return
            if i % CALLS_PER_USER_TURN == 0:
                kept = put({**user, "message": {**user["message"], "content": [
                    {"type": "text", "text": f"user turn {i}: go on with the refactor"}]}})
            cid = f"call_{i:08d}"
            blocks = [{**b, "id": cid} if b.get("type") == "toolCall" else b for b in call["message"]["content"]]
            put({**call, "message": {**call["message"], "content": blocks}})
            put({**result, "message": {**result["message"], "toolCallId": cid,
                                       "content": [{"type": "text", "text": _padded(i)}]}})
            history += OUTPUT_BYTES + 800
            if i % CALLS_PER_USER_TURN == CALLS_PER_USER_TURN - 1:
                put(answer)
            if history > CONTEXT_BYTES:  # pi's compaction: a summary, then the entries from the last prompt
                put({"type": "compaction", "timestamp": user["timestamp"], "summary": f"Summary {i}.",
                     "firstKeptEntryId": kept, "tokensBefore": 250000})
                history = 0


WRITERS = {"claude-code": (write_claude_session, "efe4eb98-da5c-4c54-8f08-1e2f0925168f.jsonl"),
           "pi": (write_pi_session, "2026-12-02T06-51-00-293Z_01a23585-5544-7373-a76e-3fd2faf116cf.jsonl")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="50,500", help="comma-separated file sizes in MB")
    ap.add_argument("--harness", default="claude-code,pi")
    ap.add_argument("--tmp", help="directory for the files and databases (default: the system's)")
    ap.add_argument("--baseline", type=Path, help="also import each file with this checkout, side by side")
    ap.add_argument("--baseline-max-mb", type=float, default=float("inf"),
                    help="run the baseline only up to this size (a whole read of a large file takes GBs)")
    args = ap.parse_args()
    for harness in args.harness.split(","):
        write, name = WRITERS[harness]
        results = []
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            for mb in (float(x) for x in args.sizes.split(",")):
                src = Path(tmp) / f"{mb:g}" / name
                src.parent.mkdir()
                write(src, mb)
                result = {"harness": harness, "file_mb": round(src.stat().st_size / 1e6, 1),
                          **import_in_child(src, Path(tmp) / "this.db", ROOT)}
                if args.baseline is not None and mb <= args.baseline_max_mb:
                    result["baseline"] = import_in_child(src, Path(tmp) / "baseline.db", args.baseline)
                src.unlink()
                results.append(result)
                print(json.dumps(result), flush=True)
        print(json.dumps({"harness": harness,
                          "peak_rss_largest_to_smallest": round(results[-1]["peak_rss_mb"] / results[0]["peak_rss_mb"], 2),
                          "file_largest_to_smallest": round(results[-1]["file_mb"] / results[0]["file_mb"], 1)}),
              flush=True)


if __name__ == "__main__":
    main()

"""Importing a long Codex rollout: database size against the rollout's size, seconds, peak memory.

    python bench/bench_rollout_import.py [--calls 286] [--mb 1] [--calls 286 --mb 50]
    python bench/bench_rollout_import.py --sizes 50,500[,2000]

With --sizes, a rollout of each size in MB is written the way long Codex sessions grow (built from
the fixture's line shapes: user turns of several tool calls, `event_msg` lines, and a remote
compaction each time the history passes CONTEXT_BYTES, as Codex compacts at its context limit),
imported by `prefixtrace import` in a child process, and one line per size prints the import's
seconds, its peak RSS (the child's own, from wait4) and database size / rollout size; a last line
the peak RSS of the largest against the smallest (flat: memory does not grow with the file).

The rollout is made from the real fixture rollout's lines (fixtures/transcripts/codex/): its head
(session_meta, developer and user messages, turn_context), then per call a `function_call`, its
`token_usage_record` and a `function_call_output` padded so the file reaches --mb megabytes. Every
call's request carries the whole history as `input` (as Codex sends it), so a database that stores
bodies whole grows as calls x history; stored content-addressed (recorder/bodies.py splits `input`
like chat `messages`) it grows with the rollout. Prints one JSON object: rollout MB, database MB,
their ratio, import seconds, and the same for a rollout of half the calls (linear growth: the size
ratio stays flat as the rollout doubles).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recorder.sources import import_path  # noqa: E402

FIX = next((ROOT / "fixtures" / "transcripts" / "codex").glob("rollout-*.jsonl"))


def rollout(calls: int, megabytes: float) -> list[dict]:
    lines = [json.loads(line) for line in FIX.read_text().splitlines()]
    head = [o for o in lines[:8] if o["type"] in ("session_meta", "response_item", "turn_context")]
    call = next(o for o in lines if o.get("payload", {}).get("type") == "function_call")
    usage = next(o for o in lines if o["type"] == "token_usage_record")
    output = next(o for o in lines if o.get("payload", {}).get("type") == "function_call_output")
    pad = max(0, int(megabytes * 1e6 / calls) - 2500)
    out = list(head)
    for i in range(calls):
        cid = f"call_{i:06d}"
        out.append({**call, "payload": {**call["payload"], "call_id": cid}})
        out.append(usage)
        text = f"output {i}\n" + ("lorem ipsum dolor sit amet " * (pad // 27 + 1))[:pad]
        out.append({**output, "payload": {**output["payload"], "call_id": cid, "output": text}})
    return out


def measure(calls: int, megabytes: float, tmp: Path) -> dict:
    src, db = tmp / f"rollout-{calls}.jsonl", tmp / f"rollout-{calls}.db"
    src.write_text("".join(json.dumps(o) + "\n" for o in rollout(calls, megabytes)))
    start = time.perf_counter()
    count, _ = import_path(src, db)
    seconds = time.perf_counter() - start
    size = sum(p.stat().st_size for p in tmp.glob(f"rollout-{calls}.db*"))
    return {"calls": count, "rollout_mb": round(src.stat().st_size / 1e6, 2), "db_mb": round(size / 1e6, 2),
            "db_to_rollout": round(size / src.stat().st_size, 2), "import_s": round(seconds, 2)}


CONTEXT_BYTES = 1_000_000  # history text at which the generated session compacts (~250k tokens)
CALLS_PER_USER_TURN = 8
OUTPUT_BYTES = 6_000  # a tool output: a file read, a test run


def write_long_rollout(path: Path, megabytes: float) -> None:
    """A rollout of `megabytes` written line by line (never held whole), shaped like a long session."""
    lines = [json.loads(line) for line in FIX.read_text().splitlines()]
    find = lambda pred: next(o for o in lines if pred(o))  # noqa: E731
    head = [o for o in lines[:8] if o["type"] in ("session_meta", "response_item", "turn_context")]
    user = find(lambda o: o.get("payload", {}).get("role") == "user")
    ctx = find(lambda o: o["type"] == "turn_context")
    call = find(lambda o: o.get("payload", {}).get("type") == "function_call")
    usage = find(lambda o: o["type"] == "token_usage_record")
    output = find(lambda o: o.get("payload", {}).get("type") == "function_call_output")
    events = [o for o in lines if o["type"] == "event_msg"]
    answer = find(lambda o: o.get("payload", {}).get("role") == "assistant")
    words = "fn main() { let x = parse(input)?; println!(\"{x:?}\"); } // lorem ipsum dolor sit amet\n"
    target, history = int(megabytes * 1e6), 0
    with open(path, "w") as fh:
        put = lambda o: fh.write(json.dumps(o) + "\n")  # noqa: E731
        for o in head:
            put(o)
        for i in itertools.count():
            if fh.tell() >= target:
                return
            if i % CALLS_PER_USER_TURN == 0:
                text = f"user turn {i // CALLS_PER_USER_TURN}: go on with the refactor"
                asked = {**user, "payload": {**user["payload"], "content": [{"type": "input_text", "text": text}]}}
                put(asked)
                put(ctx)
            cid = f"call_{i:08d}"
            put({**call, "payload": {**call["payload"], "call_id": cid}})
            put(events[i % len(events)])
            put(usage)
            body = f"output {i}\n" + (words * (OUTPUT_BYTES // len(words) + 1))[:OUTPUT_BYTES]
            put({**output, "payload": {**output["payload"], "call_id": cid, "output": body}})
            put(events[(i + 1) % len(events)])
            history += OUTPUT_BYTES + 600
            if i % CALLS_PER_USER_TURN == CALLS_PER_USER_TURN - 1:
                put(answer)
                put(usage)
            if history > CONTEXT_BYTES:  # Codex's remote compaction: the history replaced by a summary
                put({"timestamp": call["timestamp"], "type": "compacted", "payload": {"message": "", "replacement_history": [
                    asked["payload"], {"type": "compaction", "id": f"cmp_{i}", "encrypted_content": "x" * 4000}]}})
                history = 0


def import_in_child(src: Path, db: Path, repo: Path) -> dict:
    """`prefixtrace import` of `src` run from the checkout `repo`: seconds, its peak RSS (wait4), db size."""
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:  # files: wait4 must reap the child
        proc = subprocess.Popen([sys.executable, "-m", "prefixtrace.cli", "import", str(src), "--db", str(db),
                                 "--json"], cwd=repo, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - start
        out.seek(0), err.seek(0)
        out, err = out.read(), err.read()
    if proc.returncode:
        raise SystemExit(f"import of {src} failed: {err.decode()[-500:]}")
    size = sum(p.stat().st_size for p in db.parent.glob(f"{db.name}*"))
    for p in db.parent.glob(f"{db.name}*"):
        p.unlink()
    return {"turns": json.loads(out)["imported"], "import_s": round(seconds, 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "db_to_rollout": round(size / src.stat().st_size, 2)}


def measure_child(megabytes: float, tmp: Path, baseline: Path | None = None) -> dict:
    """Writes a rollout of `megabytes`, imports it in a child (and with the `baseline` checkout)."""
    src = tmp / f"rollout-{megabytes:g}mb.jsonl"
    write_long_rollout(src, megabytes)
    result = {"rollout_mb": round(src.stat().st_size / 1e6, 1), **import_in_child(src, tmp / "this.db", ROOT)}
    if baseline is not None:
        result["baseline"] = import_in_child(src, tmp / "baseline.db", baseline)
    src.unlink()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=286)
    ap.add_argument("--mb", type=float, default=1.0, help="the rollout's size in megabytes")
    ap.add_argument("--sizes", help="comma-separated rollout sizes in MB (e.g. 50,500,2000): long-session "
                                    "rollouts imported in a child, with peak RSS")
    ap.add_argument("--tmp", help="directory for the rollouts and databases (default: the system's)")
    ap.add_argument("--baseline", type=Path, help="with --sizes, also import each rollout with this checkout "
                                                   "(e.g. the main branch's), side by side")
    args = ap.parse_args()
    if args.sizes:
        results = []
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            for mb in (float(x) for x in args.sizes.split(",")):
                results.append(measure_child(mb, Path(tmp), args.baseline))
                print(json.dumps(results[-1]), flush=True)
        print(json.dumps({"peak_rss_largest_to_smallest": round(results[-1]["peak_rss_mb"] / results[0]["peak_rss_mb"], 2),
                          "rollout_largest_to_smallest": round(results[-1]["rollout_mb"] / results[0]["rollout_mb"], 1)}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        half = measure(args.calls // 2, args.mb / 2, Path(tmp))
        full = measure(args.calls, args.mb, Path(tmp))
    print(json.dumps({"half": half, "full": full,
                      "size_ratio_growth": round(full["db_to_rollout"] / max(half["db_to_rollout"], 1e-9), 2)}))


if __name__ == "__main__":
    main()

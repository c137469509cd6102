"""Recorder storage size and write speed on the synthetic field-report log.

Records the 1,260-request synthetic log (`testsupport/synthetic_log.py`, ~0.7 GB of
request JSON) through a live `Recorder` (writer thread, content-addressed
store), then compares the database file with:

    unique message content  sum of the UTF-8 sizes of the distinct message texts
    raw bodies              sum of the UTF-8 sizes of every request body

Goal (issue 4): database <= 1.2 x unique message content. Also checks that a
sample of bodies comes back byte for byte, and reports record() latency and
writer throughput.

    python bench/bench_recorder.py                 # full log, ~1 minute on 2 cores
    python bench/bench_recorder.py --requests 200  # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testsupport.synthetic_log import generate_records  # noqa: E402
from recorder import Recorder, db_info, iter_turns  # noqa: E402
from recorder.jsonl import record_to_turn  # noqa: E402

GOAL = 1.2


def run(n_requests: int, n_sessions: int, seed: int, db_path: Path, check_every: int = 50) -> dict:
    unique: dict[str, int] = {}
    raw_bytes = 0
    raws: dict[str, str] = {}  # a sample, for the byte-for-byte check
    latencies = []
    t0 = time.perf_counter()
    # A short queue keeps memory flat: each queued turn holds a ~0.5 MB body.
    with Recorder(db_path, max_queue=32) as rec:
        for n, record in enumerate(generate_records(n_requests=n_requests, n_sessions=n_sessions, seed=seed)):
            # The same text write_jsonl puts in the file: what a client sent.
            raw = json.dumps(record["request"], ensure_ascii=False)
            raw_bytes += len(raw.encode())
            for message in record["request"]["messages"]:
                text = json.dumps(message, ensure_ascii=False)
                if text not in unique:
                    unique[text] = len(text.encode())
            turn = record_to_turn(record)
            turn.request_raw = raw
            if n % check_every == 0:
                raws[turn.request_id] = raw
            start = time.perf_counter()
            rec.record(turn)
            latencies.append(time.perf_counter() - start)
        rec.flush()
    elapsed = time.perf_counter() - t0
    mismatched = [t.request_id for t in iter_turns(db_path) if t.request_id in raws and t.request_raw != raws[t.request_id]]
    info = db_info(db_path)
    size = os.path.getsize(db_path) + (os.path.getsize(f"{db_path}-wal") if Path(f"{db_path}-wal").exists() else 0)
    unique_bytes = sum(unique.values())
    latencies.sort()
    return {
        "requests": n_requests,
        "unique_messages": len(unique),
        "unique_message_bytes": unique_bytes,
        "raw_body_bytes": raw_bytes,
        "db_bytes": size,
        "db_over_unique": round(size / unique_bytes, 3),
        "raw_over_unique": round(raw_bytes / unique_bytes, 1),
        "goal": GOAL,
        "meets_goal": size <= GOAL * unique_bytes,
        "db_info_unique_message_bytes": info["unique_message_bytes"],
        "byte_exact_checked": len(raws),
        "byte_exact_mismatches": mismatched,
        "record_ms_median": round(statistics.median(latencies) * 1000, 3),
        "record_ms_p99": round(latencies[int(0.99 * (len(latencies) - 1))] * 1000, 3),
        "seconds_total": round(elapsed, 1),
        "requests_per_s": round(n_requests / elapsed, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1260)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--db", type=Path, help="keep the database here (default: a temporary file)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or Path(tmp) / "bench.db"
        result = run(args.requests, args.sessions, args.seed, db)
    print(json.dumps(result, indent=2))
    if not result["meets_goal"] or result["byte_exact_mismatches"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""Importing a long Codex rollout: database size against the rollout's size, and seconds.

    python bench/bench_rollout_import.py [--calls 286] [--mb 1] [--calls 286 --mb 50]

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
import json
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=286)
    ap.add_argument("--mb", type=float, default=1.0, help="the rollout's size in megabytes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        half = measure(args.calls // 2, args.mb / 2, Path(tmp))
        full = measure(args.calls, args.mb, Path(tmp))
    print(json.dumps({"half": half, "full": full,
                      "size_ratio_growth": round(full["db_to_rollout"] / max(half["db_to_rollout"], 1e-9), 2)}))


if __name__ == "__main__":
    main()

"""Stall per pause/resume against the KV bytes moved.

A row is paused (the test hook) once mid-decode; the stall is the gap between
the tokens around the pause minus the median gap. The KV moved is the spilled
file's size. Field report: 1.6-3.5 s per pause on a 27B model at ~100k tokens.

    python bench/bench_pause.py [--model DIR] [--contexts 1024 4096 16384]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_scheduler import bench_model_dir  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.sequence import Failed, Finished, Sequence, TextDelta  # noqa: E402
from testsupport.forced_pauses import forced_pauses  # noqa: E402


def one(engine: Engine, context: int, pause_after: int = 16) -> dict:
    prompt = [(i * 7919) % 20000 + 10 for i in range(context)]
    prompt = [t % engine.model.args.vocab_size for t in prompt]
    times = []
    events: queue.Queue = queue.Queue()

    def emit(event):
        if isinstance(event, TextDelta):
            times.append(time.perf_counter())
        events.put(event)

    seq = Sequence(prompt, SamplingParams(temperature=0.0, max_tokens=pause_after * 2, ignore_eos=True), emit)
    forced_pauses(engine).add(seq, pause_at={pause_after})
    before = engine.scheduler.spill.bytes_written
    engine.submit(seq)
    while not isinstance(event := events.get(timeout=3600), (Finished, Failed)):
        pass
    gaps = [b - a for a, b in zip(times, times[1:])]
    # the pause happens right after token `pause_after`; its stall shows in the next gap or two
    stall = max(gaps[pause_after - 2 : pause_after + 2]) - statistics.median(gaps)
    moved = engine.scheduler.spill.bytes_written - before
    return {"context_tokens": context, "kv_bytes_moved": moved, "stall_s": round(stall, 4),
            "gb_per_s": round(moved / 1e9 / max(stall, 1e-9), 3), "median_token_gap_s": round(statistics.median(gaps), 4)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    args = parser.parse_args()
    engine = Engine(bench_model_dir(args.model), dtype="float32", prefill_step_size=2048, cache_bytes=0).start()
    engine.wait_ready(600)
    one(engine, 256)  # warm-up
    rows = [one(engine, c) for c in args.contexts]
    engine.shutdown()
    print(json.dumps({"model": engine.name, "pauses": rows}, indent=2))


if __name__ == "__main__":
    main()

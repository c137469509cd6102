"""Transcript reading on long sessions: Claude Code and pi sessions made from the real fixtures'
lines (one prompt, one reply per call, each call's history the whole chain before it), read at N and
2N calls in the same run.

    python bench/bench_transcripts.py [--calls 1000]

Prints one JSON object per harness: seconds at N and 2N, their ratio, how many message references
the turns hold at 2N and how many distinct message objects. Every request carries its whole history
(as on the wire), so the references grow as calls x history and the time up to 4x for 2N; the
conversion itself is linear: the distinct objects are 2 per call (shared by every later call's
history, not rebuilt per call; tests/test_transcripts.py::test_calls_share_their_history_objects).
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

from recorder.transcripts import read_transcripts  # noqa: E402

FIX = ROOT / "fixtures" / "transcripts"


def _lines(harness: str) -> list[dict]:
    path = next(p for p in (FIX / harness).iterdir() if p.suffix == ".jsonl" and p.name != "recording.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def claude_session(n: int) -> list[dict]:
    lines = _lines("claude")
    user = next(o for o in lines if o["type"] == "user")
    reply = next(o for o in lines if o["type"] == "assistant")
    out, parent = [], None
    for i in range(n):
        out.append({**user, "uuid": f"u{i}", "parentUuid": parent,
                    "message": {"role": "user", "content": f"prompt {i} " + "x" * 2000}})
        out.append({**reply, "uuid": f"a{i}", "parentUuid": f"u{i}",
                    "message": {**reply["message"], "id": f"m{i}", "content": [{"type": "text", "text": "y" * 500}]}})
        parent = f"a{i}"
    return out


def pi_session(n: int) -> list[dict]:
    lines = _lines("pi")
    head, user = lines[:3], next(o for o in lines if o.get("message", {}).get("role") == "user")
    reply = [o for o in lines if o.get("message", {}).get("role") == "assistant"][-1]
    out, parent = list(head), head[-1]["id"]
    for i in range(n):
        text = [{"type": "text", "text": f"prompt {i} " + "x" * 2000}]
        out.append({**user, "id": f"u{i}", "parentId": parent, "message": {**user["message"], "content": text}})
        out.append({**reply, "id": f"a{i}", "parentId": f"u{i}"})
        parent = f"a{i}"
    return out


def timed(lines: list[dict], tmp: Path, name: str) -> tuple[float, int, int]:
    path = tmp / name
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    start = time.perf_counter()
    [t] = read_transcripts(path)
    seconds = time.perf_counter() - start
    held = [m for turn in t.turns for m in turn.request_body["messages"]]
    return seconds, len(held), len({id(m) for m in held})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for harness, build in (("claude-code", claude_session), ("pi", pi_session)):
            n = args.calls
            s1, held1, distinct1 = timed(build(n), Path(tmp), f"{harness}-{n}.jsonl")
            s2, held2, distinct2 = timed(build(2 * n), Path(tmp), f"{harness}-{2 * n}.jsonl")
            print(json.dumps({"harness": harness, "calls": [n, 2 * n], "seconds": [round(s1, 3), round(s2, 3)],
                              "ratio_2n_to_n": round(s2 / s1, 2), "messages_held_2n": held2,
                              "distinct_message_objects_2n": distinct2}))


if __name__ == "__main__":
    main()

"""Soak the recorder: many streaming clients that hang up at random points.

Starts a real `prefixtrace serve` (tiny fixture model, a fresh database) on
127.0.0.1 and runs `--clients` concurrent clients for `--seconds`. Each client
sends streamed chat requests back to back; a `--disconnect` share of them hangs
up at a random point: before the response headers, after a random number of
events, or right after the finish chunk (its turn then waits for the commit,
the moment that killed the writer in issue 14). Afterwards it checks:

    every request the server answered is recorded exactly once
    (requests cut before the headers may never have reached it: counted apart)
    a normal request still answers promptly and /health is 200
    SIGTERM stops the server

    python bench/soak_recorder.py                          # 64 clients x 120 s, 20 % hang-ups
    python bench/soak_recorder.py --clients 16 --seconds 15

Prints one JSON object: requests / completed / disconnects / recorded / lost /
duplicates, the normal request's latency and the shutdown time. Exit status 1
when anything was lost or duplicated or the server did not answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testsupport.recorder_soak import healthy, soak  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--disconnect", type=float, default=0.2, help="share of requests that hang up")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    result = soak(args.clients, args.seconds, args.disconnect, args.seed, args.max_tokens)
    print(json.dumps(result, indent=2))
    sys.exit(0 if healthy(result) else 1)


if __name__ == "__main__":
    main()

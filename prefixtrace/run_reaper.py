"""What `prefixtrace run` leaves to clean up if it dies, even by SIGKILL: `python -m prefixtrace.run_reaper DIR`.

`run` starts this first, in a session of its own, and keeps the write end of its stdin. It
writes `pgid N` for each process group it starts (its `serve`, its harness) and `done` when
it has stopped them itself. When the pipe closes without `done` (run died), this process sends
each group SIGTERM, SIGKILL to what is left after `GRACE_S`, and removes DIR, the scratch
directory that holds the harness's temporary config and keys. A pipe is used because its
end-of-file reaches the reader however the writer dies.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

GRACE_S = 40.0  # serve drains its recorder on SIGTERM (prefixtrace/serve.py RECORDER_CLOSE_S)


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a group of someone else's: the number was reused
        return False
    return True


def _signal(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap(groups: list[int], grace_s: float = GRACE_S) -> None:
    for pgid in groups:
        _signal(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pgid in groups:
        if _alive(pgid):
            _signal(pgid, signal.SIGKILL)


def main(scratch: str) -> None:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):  # outlive run's own end
        signal.signal(sig, signal.SIG_IGN)
    groups: list[int] = []
    done = False
    for line in sys.stdin:
        word, _, value = line.strip().partition(" ")
        if word == "pgid" and value.isdigit() and int(value) > 1:
            groups.append(int(value))
        elif word == "done":
            done = True
    if not done:
        reap(groups)
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1])

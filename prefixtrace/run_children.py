"""The processes `prefixtrace run` starts, and how none outlives it: the harness in a process
group of its own (given the terminal when run has it), told by the kernel when run dies
(PR_SET_PDEATHSIG), and a reaper (prefixtrace/run_reaper.py) that stops every group run started
and removes its scratch directory once run is gone, however it went."""

from __future__ import annotations

import collections
import ctypes
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int, sig: int) -> None:
    """In a child before exec: `sig` when the process that started it exits (Linux only)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # it died before the prctl took effect
            os._exit(128 + sig)


class Reaper:
    """A watcher in a session of its own that cleans up after run if run dies before `done`."""

    def __init__(self, scratch: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", "prefixtrace.run_reaper", str(scratch)],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, text=True)

    def watch(self, pgid: int) -> None:
        self._say(f"pgid {pgid}")

    def done(self) -> None:
        """run stopped its children and removed its scratch itself: the reaper only exits."""
        self._say("done")
        self.proc.stdin.close()
        self.proc.wait(30)

    def _say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()


def _terminal() -> int | None:
    """stdin's terminal when run's process group is in its foreground, else None."""
    try:
        return 0 if os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp() else None
    except OSError:
        return None


def _give_terminal(fd: int, pgid: int) -> None:
    old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background group may then set it
    try:
        os.tcsetpgrp(fd, pgid)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, old)


def run_in_own_group(cmd: list[str], env: dict[str, str], reaper: Reaper | None,
                     tail: collections.deque | None = None) -> int:
    """`cmd` on this terminal in a process group of its own, dying with this process; its exit
    code (128+N for signal N). INT, TERM and HUP sent to run go to the whole group; the terminal's
    ^C reaches it directly, as its group is the terminal's foreground. `tail` gets the last lines
    of its stderr where that is not a terminal (on one, the user sees them)."""
    parent, tty = os.getpid(), _terminal()
    teed = tail is not None and not os.isatty(2)

    def child_setup():
        os.setpgid(0, 0)
        _die_with_parent(parent, signal.SIGTERM)
        if tty is not None:
            _give_terminal(tty, os.getpgrp())

    forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {sig: signal.getsignal(sig) for sig in forwarded}
    proc = subprocess.Popen(cmd, env=env, preexec_fn=child_setup,  # OSError: the caller says which
                            stderr=subprocess.PIPE if teed else None)
    copier = _tee(proc.stderr, tail) if teed else None
    try:
        if reaper is not None:
            reaper.watch(proc.pid)
        for sig in forwarded:
            signal.signal(sig, lambda signum, frame: _signal_group(proc.pid, signum))
        code = proc.wait()
        if copier is not None:
            copier.join(5)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if tty is not None:
            _give_terminal(tty, os.getpgrp())
    return 128 - code if code < 0 else code


def _tee(pipe, tail: collections.deque) -> threading.Thread:
    """Copies the harness's stderr to run's as it comes, keeping its last lines."""

    def copy():
        out = sys.stderr.buffer
        for line in pipe:
            out.write(line)
            out.flush()
            tail.append(line.decode(errors="replace").rstrip())

    thread = threading.Thread(target=copy, name="prefixtrace-run-stderr", daemon=True)
    thread.start()
    return thread


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass

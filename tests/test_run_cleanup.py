"""`prefixtrace run` killed by any signal leaves nothing behind (prefixtrace/run_children.py,
prefixtrace/run_reaper.py): not its serve, not its harness or the harness's own children, not the
scratch directory holding the harness's keys. Real processes: run, the serve it starts, a harness."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testsupport.servers import ROOT, running_server
from tests.test_run_trust import capturing_app

SLEEPY_LLM = """#!{python}
# llm as far as `run` can tell: notes where run put its keys, starts a child, then waits.
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open({notes!r}, "w") as f:
    f.write(f"{{os.getpid()}} {{child.pid}} {{os.environ['LLM_USER_PATH']}}")
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its parent has finished
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def pids_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return [p for p in found if alive(p)]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL])
def test_run_killed_leaves_no_process_and_no_key_file(tmp_path, sig):
    if sig != signal.SIGKILL and signal.getsignal(sig) == signal.SIG_IGN:
        # An ignored signal stays ignored through exec (nohup's SIGHUP, a background job's SIGINT): the
        # harness inherits it, as a user's would, and outlives the signal run forwards. Nothing to test.
        pytest.skip(f"{sig.name} is ignored in this process, so the harness rightly ignores it too")
    notes = tmp_path / "notes"
    exe = tmp_path / "llm"
    exe.write_text(SLEEPY_LLM.format(python=sys.executable, notes=str(notes)))
    exe.chmod(0o755)
    db = tmp_path / f"run-{sig.name}.db"
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_RUNTIME_DIR": str(runtime), "OPENAI_API_KEY": "sk-x"}
    with running_server(capturing_app([])) as upstream:
        run = subprocess.Popen([sys.executable, "-m", "prefixtrace.cli", "run", "--url", "http://127.0.0.1:9",
                                "--db", str(db), "--exe", str(exe), "--serve-args", f"--upstream {upstream}/v1",
                                "llm", "hi"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not (notes.exists() and notes.read_text().count(" ") == 2):
            assert run.poll() is None and time.monotonic() < deadline, run.stderr.read().decode()
            time.sleep(0.1)
        harness, grandchild, keys_dir = notes.read_text().split(" ")
        scratch = Path(keys_dir).parent.parent
        assert (Path(keys_dir) / "keys.json").exists() and str(scratch).startswith(os.environ.get("TMPDIR", "/tmp"))
        serve = pids_naming(str(db))
        assert len([p for p in serve if p != run.pid]) >= 1
        run.send_signal(sig)
        run.wait(60)
        left = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            left = [p for p in (int(harness), int(grandchild), *serve) if p != run.pid and alive(p)]
            if not left and not scratch.exists():
                break
            time.sleep(0.2)
    assert left == [], f"still running after run got {sig.name}: {left}"
    assert not scratch.exists(), f"{scratch} (the harness's keys) left behind after {sig.name}"

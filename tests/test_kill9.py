"""`kill -9` of a real `prefixtrace serve` under load loses no turn whose response had finished."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from recorder import iter_turns
from tests.conftest import TINY_MODEL
from tests.test_cli_serve import serve_process


def client_loop(url: str, worker: int, finished: list, stop: threading.Event) -> None:
    """Sends requests back to back; a marker counts as finished only once the
    client has seen the whole response ([DONE], or the whole JSON body)."""
    with httpx.Client(timeout=30) as client:
        i = 0
        while not stop.is_set():
            marker = f"w{worker}-{i}"
            body = {"model": "default", "max_tokens": 6, "stream": i % 2 == 0,
                    "messages": [{"role": "user", "content": f"say {marker}"}]}
            try:
                if body["stream"]:
                    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                        done = r.status_code == 200 and any(line.strip() == "data: [DONE]" for line in r.iter_lines())
                else:
                    r = client.post(url + "/v1/chat/completions", json=body)
                    done = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None
            except httpx.HTTPError:
                return  # the server is gone
            if done:
                finished.append(marker)
            i += 1


@pytest.mark.slow
def test_kill_9_under_load_keeps_every_finished_turn(tmp_path):
    db = tmp_path / "traffic.db"
    finished: list[str] = []
    stop = threading.Event()
    # PREFIXTRACE_NO_OPENBLAS: no re-exec at start-up, so proc.pid is the server itself.
    with serve_process(["--model", str(TINY_MODEL), "--db", str(db)], cwd=tmp_path,
                       env={"PREFIXTRACE_NO_OPENBLAS": "1"}) as (url, proc):
        workers = [threading.Thread(target=client_loop, args=(url, w, finished, stop)) for w in range(6)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 30
        while len(finished) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # mid-load: other requests are in flight
        proc.wait(10)
        stop.set()
        for w in workers:
            w.join(30)
    assert proc.returncode == -signal.SIGKILL
    assert len(finished) >= 40
    stored = {t.request_body["messages"][0]["content"].removeprefix("say ") for t in iter_turns(db)}
    lost = [m for m in finished if m not in stored]
    assert not lost, f"{len(lost)} finished turn(s) lost: {lost[:5]}"

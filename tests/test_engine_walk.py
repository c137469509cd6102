"""The engine side of one chat request's walk (`python -m testsupport.request_walk`, docs/ARCHITECTURE.md
"The path of one request"): the engine thread runs no proxy code, and an engine file is entered a second
time on the way in only through the doors named below, each for the reason given. A new round trip (a
part calling back into one it was called from, a second part asking what the first could have passed
on) fails here with the walk's own words for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testsupport.servers import ROOT

pytestmark = pytest.mark.slow

ENGINE_SIDE = ("engine/", "prefixtrace/wire/sampling.py")
# (file, caller) -> why that second door stays.
KEPT = {
    ("engine/engine.py", "proxy/engine_backend.py"):
        "the prompt renders in a worker thread (so the loop never tokenizes); fit and submit are asked on the loop",
    ("engine/reply_parser.py", "proxy/engine_backend.py"):
        "the planner reads the model's reply format in a worker thread; the reply is parsed on the loop",
    ("engine/sequence.py", "engine/decode_batch.py"):
        "the part holding a sequence's row tells its reader the text (Outbox.put)",
    ("engine/sequence.py", "engine/scheduler.py"):
        "the scheduler ends a sequence: reads its counts and tells its reader (Outbox.put)",
    ("engine/prefix_cache.py", "engine/scheduler.py"):
        "the prefix cache is a store its users ask directly: admission looks up and commits, the scheduler "
        "stores an ended row's KV",
}


@pytest.fixture(scope="module")
def walks(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("walk") / "walk.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "testsupport.request_walk", "--json", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def _reentries(walk: list[dict]) -> list[tuple[str, str, str]]:
    """(file, caller, "caller (function)") for every second door on the way in."""
    return [(w["file"], again.split(" (", 1)[0], again) for w in walk for again in w["reentries_in"]]


def test_the_engine_thread_runs_no_proxy_code(walks):
    for name, walk in walks.items():
        proxy_from_engine = [again for file, caller, again in _reentries(walk)
                             if file.startswith("proxy/") and (caller.startswith("engine/") or caller == "(prefixtrace-engine)")]
        assert not proxy_from_engine, f"{name}: the engine thread calls back into the proxy: {proxy_from_engine}"


def test_engine_files_are_entered_once_on_the_way_in_but_for_the_named_doors(walks):
    for name, walk in walks.items():
        extra = [f"{file} <- {again}" for file, caller, again in _reentries(walk)
                 if file.startswith(ENGINE_SIDE) and (file, caller) not in KEPT]
        assert not extra, f"{name}: engine files entered again on the way in: {extra}"


def test_every_named_door_is_still_used(walks):
    """A door that no walk takes any more is struck from the list, so the list stays the truth."""
    seen = {(file, caller) for walk in walks.values() for file, caller, _ in _reentries(walk)}
    assert not set(KEPT) - seen, f"named doors no walk takes: {sorted(set(KEPT) - seen)}"

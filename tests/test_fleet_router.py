"""prefixtrace in front of a real router (sglang-router, vllm-router) with tiny-model workers behind it.

Everything runs on loopback: `prefixtrace serve` workers (subprocesses, each its own port and
database), the router binary from PyPI, and a prefixtrace proxy in front (docs/FLEET.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from testsupport.fleet import front_proxy, router, router_available, workers
from testsupport.servers import ROOT, stop


def rows(recorder) -> list[dict]:
    """The front proxy's recorded turns, oldest first (`turn_log`: `served_by` is not in the v1 `turns` view)."""
    import sqlite3

    recorder.flush()
    con = sqlite3.connect(recorder.path)
    con.row_factory = sqlite3.Row
    out = [dict(r) for r in con.execute("select * from turn_log order by started_at")]
    con.close()
    return out

# Subprocess workers and routers: seconds each (the core suite, `-m "not slow"`, leaves them out).
pytestmark = pytest.mark.slow

SGLANG = router_available("sglang")
VLLM = router_available("vllm")
needs_sglang = pytest.mark.skipif(SGLANG is not None, reason=str(SGLANG))
needs_vllm = pytest.mark.skipif(VLLM is not None, reason=str(VLLM))

SYSTEM = "You are a careful coding agent. Read the files before you change them and run the tests. " * 3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Two tiny-model workers (w1, w2) shared by the tests that leave them running."""
    with workers(2, tmp_path_factory.mktemp("fleet")) as ws:
        yield ws


def turn(url: str, session: str, messages: list[dict]) -> tuple[dict, str]:
    """One streamed turn through the front proxy; (usage, reply text)."""
    text, usage = [], None
    body = {"model": "default", "messages": messages, "max_tokens": 4, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session},
                      timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                text += [(c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or ()]
    return usage, "".join(text)


def conversation(url: str, session: str, turns: int, history: list[dict] | None = None) -> list[dict]:
    messages = history or [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": f"Session {session}: fix the failing test in module {session}."}]
    for t in range(turns):
        _, reply = turn(url, session, messages)
        messages = messages + [{"role": "assistant", "content": reply or "ok"},
                               {"role": "user", "content": f"Step {t}: still failing at line {40 + t}, look again."}]
    return messages


def by_session(recorded: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for row in recorded:
        out.setdefault(row["session_id"], []).append(row["served_by"])
    return out


def worker_headers(fleet) -> list[dict]:
    """The request headers each worker recorded (what reached it through the router)."""
    import sqlite3

    seen = []
    for url, name, proc in fleet:
        db = proc.args[proc.args.index("--db") + 1]
        con = sqlite3.connect(db)
        for (headers,) in con.execute("select request_headers from turn_log"):
            seen.append({**{k.lower(): v for k, v in json.loads(headers).items()}, "_worker": name})
        con.close()
    return seen


def sticky_sessions_through(router_url: str, tmp_path, key_header: str, fleet) -> None:
    sessions = [f"{key_header}-{name}" for name in ("alpha", "beta", "gamma")]
    with front_proxy([router_url], tmp_path / "front.db") as (front, rec):
        for session in sessions:
            conversation(front, session, 3)
        recorded = rows(rec)
    served = by_session(recorded)
    names = {name for _, name, _ in fleet}
    assert set(served) == set(sessions)
    for session, workers_seen in served.items():
        assert len(workers_seen) == 3
        # Each turn names the worker that answered (its X-Prefixtrace-Worker), not the router.
        assert set(workers_seen) <= names, workers_seen
        assert len(set(workers_seen)) == 1, f"{session} moved between workers: {workers_seen}"
    # The session id reached the router as its routing key, and the worker that served it.
    got = {h[key_header]: h["_worker"] for h in worker_headers(fleet) if key_header in h}
    assert set(sessions) <= set(got), got
    for session, workers_seen in served.items():
        assert got[session] == workers_seen[0]


@needs_sglang
def test_sglang_router_manual_policy_keeps_each_session_on_one_worker(fleet, tmp_path):
    with router("sglang", "manual", [u for u, _, _ in fleet]) as (url, _):
        sticky_sessions_through(url, tmp_path, "x-smg-routing-key", fleet)


@needs_vllm
def test_vllm_router_consistent_hash_keeps_each_session_on_one_worker(fleet, tmp_path):
    with router("vllm", "consistent_hash", [u for u, _, _ in fleet]) as (url, _):
        sticky_sessions_through(url, tmp_path, "x-session-id", fleet)


@needs_sglang
def test_round_robin_moves_a_session_and_each_turn_names_its_worker(fleet, tmp_path):
    """Under round_robin a session's turns alternate between the two workers: served_by says which."""
    with router("sglang", "round_robin", [u for u, _, _ in fleet]) as (url, _), \
            front_proxy([url], tmp_path / "front.db") as (front, rec):
        conversation(front, "delta", 4)
        served = by_session(rows(rec))["delta"]
    assert len(set(served)) == 2, served


@needs_vllm
def test_a_worker_lost_mid_session_is_named_a_routing_miss(tmp_path):
    """A session's worker stops; the router sends the next turn to the other worker, which does not hold
    the prefix. The turn records the new worker, and `prefixtrace analyze` names the miss as routing."""
    with workers(2, tmp_path) as fleet:
        urls = {name: (url, proc) for url, name, proc in fleet}
        with router("vllm", "consistent_hash", [u for u, _, _ in fleet],
                    "--health-check-interval-secs", "1", "--health-failure-threshold", "1") as (rurl, _), \
                front_proxy([rurl], tmp_path / "front.db") as (front, rec):
            history = conversation(front, "epsilon", 2)
            first = by_session(rows(rec))["epsilon"]
            assert len(set(first)) == 1
            stop(urls[first[0]][1])  # the session's worker goes away mid-session
            deadline = time.monotonic() + 30
            while True:  # until the router has taken it out (its health check) and answers from the other
                try:
                    usage, _ = turn(front, "epsilon", history)
                    break
                except AssertionError:
                    assert time.monotonic() < deadline, "the router never moved the session"
                    time.sleep(0.5)
            recorded = [r for r in rows(rec) if r["status"] == 200]
        served = [r["served_by"] for r in recorded]
        assert served[:2] == first and served[-1] != first[0], served
        # The new worker had to prefill what the old one held.
        assert usage["prompt_tokens_details"]["cached_tokens"] < recorded[1]["cached_tokens"] + 16

    from analyzer import causes

    if not hasattr(causes, "server_miss"):
        pytest.skip("the analyzer names server-side misses (server_miss, subtype routing) with branch answer-numbers")
    out = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "analyze", str(tmp_path / "front.db"),
                          "--format", "json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode in (0, 1), out.stderr
    report = json.loads(out.stdout)
    turns = [t for s in report["sessions"] for t in s["turns"]]
    last = turns[-1]
    assert last["break"] and last["break"]["cause"] == "server_miss", last
    assert last["break"]["subtype"] == "routing", last["break"]
    assert last["served_by"] == served[-1]


def test_every_upstream_turn_names_the_worker_that_answered(fleet, tmp_path):
    """No router needed: a proxy in front of one worker records the worker's X-Prefixtrace-Worker as
    `served_by` on chat, legacy completions, Messages and Responses turns, streamed and not, and the
    session id reaches the worker as both routers' routing key."""
    worker_url, name, _ = fleet[0]
    msgs = [{"role": "user", "content": "hi"}]
    asks = [("/v1/chat/completions", {"messages": msgs}), ("/v1/completions", {"prompt": "hi"}),
            ("/v1/messages", {"messages": msgs}), ("/v1/responses", {"input": "hi"})]
    r = httpx.get(worker_url + "/health", timeout=10)
    assert r.headers["x-prefixtrace-worker"] == name  # every response of `serve` names it, /health too
    with front_proxy([worker_url], tmp_path / "front.db") as (front, rec):
        for path, body in asks:
            for stream in (False, True):
                limit = {"max_output_tokens": 4} if path == "/v1/responses" else {"max_tokens": 4}
                r = httpx.post(front + path, json={"model": "default", "stream": stream, **limit, **body},
                               headers={"X-Session-Id": f"zeta{path}"}, timeout=60)
                assert r.status_code == 200, (path, r.text)
        recorded = rows(rec)
    assert [(t["endpoint"], t["served_by"]) for t in recorded] == [(p, name) for p, _ in asks for _ in (0, 1)]
    sent = [h for h in worker_headers(fleet) if str(h.get("x-session-id", "")).startswith("zeta")]
    assert len(sent) == 8 and all(h["x-smg-routing-key"] == h["x-session-id"] == h["x-dynamo-session-id"] for h in sent)


def test_worker_name_must_fit_in_a_header(clean_env):
    from click.testing import CliRunner

    from prefixtrace.cli import cli

    ok = CliRunner().invoke(cli, ["serve", "--print-config", "--worker-name", "gpu-1.rack2"])
    assert ok.exit_code == 0 and json.loads(ok.output)["options"]["worker_name"]["value"] == "gpu-1.rack2"
    for bad in ("two\nlines", "", "x" * 201, "naïve"):
        out = CliRunner().invoke(cli, ["serve", "--print-config", "--worker-name", bad])
        assert out.exit_code == 2 and "--worker-name" in out.output, (bad, out.output)

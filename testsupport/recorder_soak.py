"""The recorder soak: many streaming clients that hang up at random points against a real
`prefixtrace serve` (tiny fixture model, a fresh database); bench/soak_recorder.py runs it at full size,
tests/test_recorder_soak.py briefly. A `--disconnect` share of the requests hangs up before the response
headers, after a random number of events, or right after the finish chunk (its turn then waits for the
commit). `soak` returns what `healthy` checks: every request the server answered recorded exactly once
(requests cut before the headers may never have reached it: counted apart), a normal request still
answering promptly, /health 200, and the server stopping on SIGTERM."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from recorder import iter_turns
from testsupport.servers import start_serve, terminate

MARK = "soak "


class Tally:
    def __init__(self):
        self.sent: list[str] = []
        self.completed: list[str] = []  # saw [DONE]
        self.answered: list[str] = []  # got response headers (the server has the request)
        self.cut_before_headers: list[str] = []
        self.disconnects = 0
        self.errors: Counter = Counter()


async def one_request(client: httpx.AsyncClient, url: str, marker: str, rng: random.Random, p_cut: float,
                      tally: Tally, max_tokens: int) -> None:
    body = {"model": "default", "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": MARK + marker}]}
    tally.sent.append(marker)
    cut = rng.random() < p_cut
    mode = rng.choice(("before_headers", "mid_stream", "after_finish")) if cut else None
    if cut:
        tally.disconnects += 1

    async def run() -> None:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            tally.answered.append(marker)
            if r.status_code != 200:
                tally.errors[f"status {r.status_code}"] += 1
                return
            stop_after = rng.randint(0, max_tokens + 1) if mode == "mid_stream" else None
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    tally.completed.append(marker)
                    return
                events += 1
                if stop_after is not None and events > stop_after:
                    return  # leaving the block closes the connection mid-stream
                if mode == "after_finish" and '"finish_reason":"' in line.replace(" ", ""):
                    return  # hang up while the turn waits for its commit

    try:
        if mode == "before_headers":
            try:
                await asyncio.wait_for(run(), rng.uniform(0.0, 0.05))
            except TimeoutError:
                if marker not in tally.answered:
                    tally.cut_before_headers.append(marker)
        else:
            await run()
    except httpx.HTTPError as exc:
        tally.errors[type(exc).__name__] += 1


async def client_loop(worker: int, url: str, until: float, p_cut: float, seed: int, tally: Tally,
                      max_tokens: int) -> None:
    rng = random.Random(seed * 1000 + worker)
    # One connection per request: a hang-up closes it, as a harness killed mid-turn would.
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=httpx.Limits(max_keepalive_connections=0)) as client:
        i = 0
        while time.monotonic() < until:
            await one_request(client, url, f"w{worker}-{i}", rng, p_cut, tally, max_tokens)
            i += 1


def soak(clients: int, seconds: float, p_cut: float, seed: int = 0, max_tokens: int = 8,
         workdir: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(workdir or tmp)
        db = work / "soak.db"
        proc, url = start_serve(db, work / "serve.log")
        tally = Tally()
        try:
            until = time.monotonic() + seconds

            async def main():
                await asyncio.gather(*(client_loop(w, url, until, p_cut, seed, tally, max_tokens)
                                       for w in range(clients)))

            t0 = time.monotonic()
            asyncio.run(main())
            soak_s = time.monotonic() - t0
            # Afterwards an ordinary request must answer promptly and /health be ok.
            t1 = time.monotonic()
            try:
                r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                    "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": MARK + "after"}]})
                after_status = r.status_code
            except httpx.HTTPError as exc:
                after_status = type(exc).__name__
            after_s = time.monotonic() - t1
            try:
                health = httpx.get(url + "/health", timeout=10).status_code
            except httpx.HTTPError as exc:
                health = type(exc).__name__
        finally:
            stopped, shutdown_s = terminate(proc, 90)
        recorded = Counter(
            t.request_body["messages"][0]["content"].removeprefix(MARK)
            for t in iter_turns(db)
            if isinstance(t.request_body, dict) and str(t.request_body["messages"][0].get("content", "")).startswith(MARK)
        )
    answered = set(tally.answered)
    lost = sorted(m for m in answered if recorded[m] == 0)
    duplicates = sorted(m for m, n in recorded.items() if n > 1)
    cut_early = set(tally.cut_before_headers)
    return {
        "clients": clients,
        "seconds": round(soak_s, 1),
        "disconnect_share": p_cut,
        "requests": len(tally.sent),
        "completed": len(tally.completed),
        "disconnects": tally.disconnects,
        "cut_before_headers": len(cut_early),
        "cut_before_headers_recorded": sum(1 for m in cut_early if recorded[m]),
        "answered": len(answered),
        "recorded": sum(n for m, n in recorded.items() if m != "after"),
        "lost": len(lost),
        "lost_sample": lost[:5],
        "duplicates": len(duplicates),
        "client_errors": dict(tally.errors),
        "after_status": after_status,
        "after_recorded": recorded["after"] == 1,
        "after_s": round(after_s, 2),
        "health_after": health,
        "shutdown_s": round(shutdown_s, 1),
        "stopped_on_sigterm": stopped,
    }


def healthy(result: dict) -> bool:
    return (result["lost"] == 0 and result["duplicates"] == 0 and result["after_status"] == 200
            and result["after_recorded"] and result["health_after"] == 200 and result["stopped_on_sigterm"])

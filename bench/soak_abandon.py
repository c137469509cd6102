"""Soak: clients that give up before their first token (issue 25, finding 1).

Starts a real `prefixtrace serve` on 127.0.0.1 (the bundled default model unless `--model`), a fresh
database, and runs `--clients` concurrent clients for `--seconds`. A `--give-up` share of the
clients gives up on every request it sends: at a random point in [0, `--give-up-max-s`] after the
request went out it closes the socket, unless the first token came before (then it reads the reply
to its end like the others). Before the first token means queued or prefilling in the engine, the
case that used to lose the turn and leave the sequence in the engine. Requests are streamed or not
at random; prompts vary in length (a shared system prompt, then 20 to `--max-words` words), so some
are caught mid-prefill. Each request's body carries a unique marker, so its recorded turn is found.

Afterwards it measures:

    turns sent (bodies fully written) / recorded / unrecorded (must be 0) / recorded twice
    the stages the abandoned turns were recorded with (499, "client disconnected (<stage>)")
    the engine's waiting / prefilling / running counts `--settle-s` seconds after the load ended,
    and how long the engine took to have nothing in flight
    a normal request's time afterwards (three in a row: the first, and the best), as a ratio to its
    best solo time of three measured before the load (same prompt, same server; goal <= 2x)
    the normal clients' request times during the load (median, max)
    how long SIGTERM took

    python bench/soak_abandon.py                        # 64 clients x 120 s, half giving up, SmolLM2
    python bench/soak_abandon.py --clients 8 --seconds 10 --model fixtures/tiny-llama

Prints one JSON object; exit status 1 when a turn was unrecorded or recorded twice, the engine was
not empty after `--settle-s`, or the normal request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from recorder import iter_turns  # noqa: E402
from testsupport.servers import start_serve, terminate  # noqa: E402

MARK = "soak-abandon "
SYSTEM = "You are a terse assistant. Answer in one short sentence."
WORDS = ("the quick brown fox jumps over the lazy dog while a cache keeps every prefix it has seen "
         "and the scheduler admits one prompt at a time in chunks").split()
STAGE = re.compile(r"^client disconnected \((\w+)\)$")
TOKEN = re.compile(rb'"content": ?"[^"]')


def start_server(db: Path, log_path: Path, model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """`prefixtrace serve` (testsupport.servers.start_serve), on the bundled model unless `model` is given;
    a first start may convert the default model, so it may take minutes."""
    return start_serve(db, log_path, extra, model=Path(model).resolve() if model else None,
                       openblas=True, ready_within_s=600)


def body_for(marker: str, words: int, stream: bool, max_tokens: int, rng: random.Random) -> dict:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return {"model": "default", "max_tokens": max_tokens, "stream": stream, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"{MARK}{marker}: {text}"}]}


class Tally:
    def __init__(self):
        self.sent: set[str] = set()  # the whole request is written: the server has it
        self.abandoned: set[str] = set()
        self.abandoned_before_first_token: set[str] = set()
        self.finished: set[str] = set()
        self.finished_s: list[float] = []  # how long each request that was read to its end took
        self.errors: Counter = Counter()


async def exchange(port: int, body: dict, marker: str, tally: Tally, give_up_after: float | None) -> None:
    """One request on its own connection, as a harness sends it; `give_up_after`: seconds after
    which the socket is closed if no token has come yet (None: read the reply to its end)."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    first_token = asyncio.Event()
    t0 = time.monotonic()
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
        await writer.drain()
        tally.sent.add(marker)

        async def read_reply() -> None:
            seen = b""
            while chunk := await reader.read(65536):
                seen += chunk
                if TOKEN.search(seen):  # streamed: a non-empty content delta; whole: the body
                    first_token.set()
            if b" 200 OK" not in seen.split(b"\r\n", 1)[0]:
                tally.errors[seen.split(b"\r\n", 1)[0].decode(errors="replace")] += 1
            else:
                tally.finished.add(marker)
                tally.finished_s.append(time.monotonic() - t0)

        reading = asyncio.ensure_future(read_reply())
        if give_up_after is None:
            await asyncio.wait_for(reading, 600)
            return
        done, _ = await asyncio.wait([reading], timeout=give_up_after)
        if reading in done:
            reading.result()
            return
        if first_token.is_set():
            await asyncio.wait_for(reading, 600)  # the token came in time: this one is kept
            return
        reading.cancel()
        tally.abandoned.add(marker)
        tally.abandoned_before_first_token.add(marker)
    except (OSError, asyncio.TimeoutError) as exc:
        tally.errors[type(exc).__name__] += 1
    finally:
        writer.close()


async def client_loop(worker: int, port: int, until: float, gives_up: bool, args, tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + worker)
    i = 0
    while time.monotonic() < until:
        marker = f"w{worker}-{i}"
        body = body_for(marker, rng.randint(20, args.max_words), rng.random() < 0.5, args.max_tokens, rng)
        await exchange(port, body, marker, tally, rng.uniform(0, args.give_up_max_s) if gives_up else None)
        i += 1


def in_engine(url: str) -> dict:
    cap = httpx.get(url + "/v1/capacity", timeout=30).json()
    return {k: cap[k] for k in ("waiting", "prefilling", "running", "paused")}


def timed_normal_request(url: str, body: dict) -> tuple[int | str, float]:
    t0 = time.monotonic()
    try:
        status = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return status, time.monotonic() - t0


def soak(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        db = work / "soak.db"
        proc, url = start_server(db, work / "serve.log", args.model, args.serve_arg)
        port = int(url.rsplit(":", 1)[1])
        tally = Tally()
        normal = body_for("normal", 64, False, args.max_tokens, random.Random(1))
        try:
            timed_normal_request(url, {**normal, "messages": [normal["messages"][0],
                                                               {"role": "user", "content": "warm up"}]})
            solo_runs = [timed_normal_request(url, normal) for _ in range(3)]
            solo_s = min(s for _, s in solo_runs)  # the same prompt: a prefix-cache hit, as afterwards

            until = time.monotonic() + args.seconds
            quitters = int(round(args.clients * args.give_up))

            async def load():
                await asyncio.gather(*(client_loop(w, port, until, w < quitters, args, tally)
                                       for w in range(args.clients)))

            t0 = time.monotonic()
            asyncio.run(load())
            load_s = time.monotonic() - t0
            ended = time.monotonic()
            drained_s = after_settle = None
            while True:  # the counts at --settle-s, and when the engine first had nothing in flight
                since = time.monotonic() - ended
                counts = in_engine(url)
                if after_settle is None and since >= args.settle_s:
                    after_settle = counts
                if drained_s is None and not any(counts.values()):
                    drained_s = since
                if after_settle is not None and (drained_s is not None or since > args.drain_limit_s):
                    break
                time.sleep(0.2)
            # The same three requests as solo: the first one afterwards, and the best of three.
            after_runs = [timed_normal_request(url, normal) for _ in range(3)]
        finally:
            stopped, shutdown_s = terminate(proc, 120)
        recorded: Counter = Counter()
        stages: Counter = Counter()
        statuses: Counter = Counter()
        for turn in iter_turns(db):
            body = turn.request_body if isinstance(turn.request_body, dict) else {}
            content = str((body.get("messages") or [{}, {}])[-1].get("content", ""))
            if not content.startswith(MARK):
                continue
            marker = content.removeprefix(MARK).split(":", 1)[0]
            recorded[marker] += 1
            if marker in tally.sent:
                statuses[turn.status] += 1
            if marker in tally.abandoned:
                match = STAGE.match(turn.error or "")
                stages[f"{turn.status} {match.group(1) if match else turn.error}"] += 1
    sent = tally.sent
    unrecorded = sorted(m for m in sent if recorded[m] == 0)
    return {
        "clients": args.clients, "giving_up": int(round(args.clients * args.give_up)),
        "seconds": round(load_s, 1), "model": args.model or "bundled default",
        "turns_sent": len(sent), "turns_recorded": sum(n for m, n in recorded.items() if m in sent),
        "unrecorded": len(unrecorded), "unrecorded_sample": unrecorded[:5],
        "recorded_twice": sum(1 for m in sent if recorded[m] > 1),
        "finished": len(tally.finished), "abandoned": len(tally.abandoned),
        "abandoned_before_first_token": len(tally.abandoned_before_first_token),
        "abandoned_recorded_as": dict(stages), "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "client_errors": dict(tally.errors),
        "engine_empty_after_s": None if drained_s is None else round(drained_s, 2),
        f"engine_{args.settle_s:g}s_after_load": after_settle,
        "normal_during_load_s": _spread(tally.finished_s),
        "normal_solo_s": [round(s, 3) for _, s in solo_runs],
        "normal_after_s": [round(s, 3) for _, s in after_runs],
        "normal_after_status": [status for status, _ in after_runs],
        "normal_after_first_ratio": round(after_runs[0][1] / solo_s, 2),  # against the best solo run
        "normal_after_best_ratio": round(min(s for _, s in after_runs) / solo_s, 2),
        "shutdown_s": round(shutdown_s, 1), "stopped_on_sigterm": stopped,
    }


def healthy(result: dict, settle_key: str) -> bool:
    return (result["unrecorded"] == 0 and result["recorded_twice"] == 0 and not any(result[settle_key].values())
            and set(result["normal_after_status"]) == {200} and result["stopped_on_sigterm"])


def _spread(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    return {"n": len(ordered), "median": round(ordered[len(ordered) // 2], 2), "max": round(ordered[-1], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--give-up", type=float, default=0.5, help="share of the clients that give up")
    ap.add_argument("--give-up-max-s", type=float, default=5.0, help="they give up at a random point in [0, this]")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-words", type=int, default=600, help="longest user message (words)")
    ap.add_argument("--settle-s", type=float, default=3.0, help="when the engine's counts are read after the load")
    ap.add_argument("--drain-limit-s", type=float, default=300, help="how long to wait for the engine to empty")
    ap.add_argument("--model", default=None, help="a model directory (default: the bundled default model)")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `serve` argument (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="keep the database and the server log here")
    args = ap.parse_args()
    result = soak(args)
    print(json.dumps(result, indent=2))
    sys.exit(0 if healthy(result, f"engine_{args.settle_s:g}s_after_load") else 1)


if __name__ == "__main__":
    main()

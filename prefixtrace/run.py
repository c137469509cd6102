"""`prefixtrace run HARNESS [ARGS...]`: a coding-agent harness launched through the proxy.

It finds a proxy answering `/health` at the given URL or starts `prefixtrace serve` on a free
loopback port (stopped when the harness exits), points the harness at
`<proxy>/s/<session>` through a configuration of its own (prefixtrace/harnesses.py: the user's
files are only read), runs it on the terminal it was started from, and when it exits prints the
session's summary from the analyzer over what was recorded under that session, then exits with
the harness's exit code.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import httpx

from prefixtrace import harnesses
from prefixtrace.instance_key import key_dir, proven_db, read_key
from prefixtrace.run_children import Reaper, run_in_own_group
from prefixtrace.run_defaults import small_model_args
from prefixtrace.common.errors import PrefixtraceError

HEALTH_TIMEOUT_S = 600.0  # a first `serve` converts the bundled model and loads it
DEFAULT_URL = "http://127.0.0.1:8765"


class RunError(PrefixtraceError):
    """`prefixtrace run` could not start the harness or the proxy."""


@dataclass
class Proxy:
    url: str
    started: subprocess.Popen | None  # None: one that was already running
    health: dict
    log: Path | None = None
    context_tokens: int | None = None
    db: Path | None = None  # where its turns are recorded

    def stop(self) -> None:
        proc = self.started
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)  # serve drains its recorder on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _health(url: str, timeout: float = 2.0) -> tuple[int, dict, httpx.Headers] | None:
    try:
        resp = httpx.get(url.rstrip("/") + "/health", timeout=timeout)
    except httpx.HTTPError:
        return None
    try:
        body = resp.json()
    except ValueError:
        body = {}
    return resp.status_code, body if isinstance(body, dict) else {}, resp.headers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen | None, log: Path | None, timeout: float) -> tuple[dict, httpx.Headers]:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            raise RunError(f"prefixtrace serve exited {proc.returncode} before it was healthy:\n{tail}")
        found = _health(url)
        if found is not None and found[0] == 200 and found[1].get("status") == "ok":
            return found[1], found[2]
        if time.monotonic() > deadline:
            raise RunError(f"the proxy at {url} was not healthy within {timeout:.0f} s"
                           + (f" (log: {log})" if log else ""))
        time.sleep(0.3)


def find_or_start_proxy(url: str, db: Path, serve_args: Sequence[str], workdir: Path,
                        say: Callable[[str], None], timeout: float = HEALTH_TIMEOUT_S, *,
                        url_given: bool = False, reaper: Reaper | None = None) -> Proxy:
    """The prefixtrace proxy answering /health at `url`, or a `prefixtrace serve --db db` started
    on a free loopback port (its output in `workdir/serve.log`).

    A proxy found there is reused only when it proves it is this user's prefixtrace (the answer to a
    nonce, prefixtrace/common/instance_proof.py), which also names its database; or, unproven, when the user gave
    `url` themselves. Anything else answering there gets none of the harness's credentials."""
    found = _health(url)
    if found is not None and found[1].get("status") in ("ok", "loading"):
        proven = proven_db(url)
        if proven is not None or url_given:
            health, headers = _wait_healthy(url, None, None, timeout)
            if proven is not None:
                db = Path(proven)
                say(f"using your prefixtrace at {url} ({health.get('backend')}), recording to {db}")
            else:
                say(f"using the proxy at {url} ({health.get('backend')}) as --url asked; it did not prove it is "
                    f"a prefixtrace serve of yours, so its turns are read back from {db}")
            return Proxy(url.rstrip("/"), None, health, None, _context(headers), db)
        say(f"{url} answers /health but did not prove it is a prefixtrace serve of yours (no key of its port "
            f"in {key_dir()}, or a wrong answer): it gets nothing; starting a proxy for this run instead")
    port = _free_port()
    log = workdir / "serve.log"
    added = small_model_args(serve_args)
    if added:
        say(f"the bundled model is small: its serve runs with {' '.join(added)} so the harness's loop can finish "
            "(--serve-args overrides them)")
        serve_args = [*serve_args, *added]
    cmd = [sys.executable, "-m", "prefixtrace.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--db", str(db), *serve_args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # the terminal's ^C is the harness's, not the proxy's
    if reaper is not None:
        reaper.watch(proc.pid)
    proxy_url = f"http://127.0.0.1:{port}"
    say(f"starting prefixtrace serve on {proxy_url} (database {db}, log {log})")
    try:
        health, headers = _wait_healthy(proxy_url, proc, log, timeout)
        # Between choosing the port and serve binding it, another process could have taken it: the one
        # answering must hold the secret serve wrote for that port (where serve could write one).
        if read_key(port) is not None and proven_db(proxy_url) != str(db):
            raise RunError(f"the process answering on {proxy_url} is not the prefixtrace serve run started "
                           f"(it did not prove it); nothing was sent to it")
    except BaseException:
        Proxy(proxy_url, proc, {}).stop()
        raise
    return Proxy(proxy_url, proc, health, log, _context(headers), db)


def _context(headers: httpx.Headers) -> int | None:
    value = headers.get("x-max-context-tokens")
    return int(value) if value and value.isdigit() else None


def served_model(proxy: Proxy) -> str:
    """The model to name where a harness must name one: "default" when the proxy serves that alias
    (the embedded engine), else the first its /v1/models lists (an upstream's)."""
    try:
        ids = [m["id"] for m in httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        ids = []
    return "default" if "default" in ids or not ids else ids[0]


def new_session_id(harness: str) -> str:
    return f"run-{harness}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"


def run_harness(cmd: list[str], env: dict[str, str], reaper: Reaper | None = None,
                tail: collections.deque | None = None) -> int:
    """The harness on this process's own stdin/stdout/terminal; its exit code (128+N for signal N)."""
    try:
        return run_in_own_group(cmd, env, reaper, tail)
    except OSError as exc:
        raise RunError(f"cannot start {cmd[0]}: {exc}") from exc


def summarize(db: Path, session: str, prefill_rate: float | None = None) -> dict:
    """The session's turns in `db`, analysed: requests, breaks (cause, where, and the one cost of each:
    seconds then tokens lost, docs/ANALYZER.md "Cost"), totals."""
    from analyzer import analyze
    from recorder.sources import load_turns

    if not Path(db).exists():
        return {"session": session, "db": str(db), "requests": 0, "breaks": [], "note": f"{db} does not exist"}
    turns = load_turns(db, session=session)
    summary = {"session": session, "db": str(db), "requests": len(turns), "breaks": [], "failed": 0,
               "lost_tokens": 0, "lost_seconds": None, "chains": 0, "side_requests": 0}
    if not turns:
        return summary
    report = analyze(turns, prefill_rate=prefill_rate)
    summary["failed"] = len(report.failed)
    summary["chains"] = sum(1 for s in report.sessions if s.kind == "main")
    summary["side_requests"] = sum(1 for s in report.sessions if s.kind != "main")
    seconds_known = False
    seconds = 0.0
    for chain, turn in report.breaks:
        tokens, secs = turn.lost_tokens, turn.lost_seconds
        if secs is not None:
            seconds_known = True
            seconds += secs
        summary["lost_tokens"] += tokens or 0
        summary["breaks"].append({"request_id": turn.request_id, "chain": chain.id, "turn": turn.index,
                                  "cause": turn.brk.cause, "subtype": turn.brk.subtype, "where": turn.brk.where(),
                                  "tokens": tokens, "seconds": secs, "fix": turn.brk.suggestion})
    if seconds_known or not report.breaks:
        summary["lost_seconds"] = round(seconds, 2)
    return summary


def format_summary(summary: dict) -> str:
    from analyzer.report import cost_text
    from prefixtrace.common.words import plural
    lines = [f"prefixtrace: session {summary['session']}: {plural(summary['requests'], 'request')} recorded in {summary['db']}"]
    if summary.get("note"):
        lines.append(f"  {summary['note']}")
    if not summary["requests"]:
        if summary.get("harness"):
            last = summary.get("last_lines")
            lines.append(f"  {summary['harness']} exited {summary['exit_code']} before sending any request through "
                         "the proxy" + (", its last lines:" if last else " (its output is above)"))
            lines += [f"    | {line}" for line in last or ()]
        else:
            lines.append("  nothing was recorded under this session")
        return "\n".join(lines)
    breaks = summary["breaks"]
    extra = f", {plural(summary['side_requests'], 'side request chain')}" if summary.get("side_requests") else ""
    failed = f", {summary['failed']} refused" if summary.get("failed") else ""
    lines.append(f"  {plural(summary['chains'], 'main chain')}{extra}{failed}; {plural(len(breaks), 'cache break')}")
    last_fix = None
    for b in breaks:
        cause = b["cause"] + (f"/{b['subtype']}" if b.get("subtype") else "")
        lines.append(f"  - request {b['turn'] + 1} of {b['chain']}: {cause} at {b['where']}: "
                     f"lost {cost_text(b['seconds'], b['tokens'] or 0)}")
        # One fix line per kind of break: a ticking value's fix names its values, different each time.
        if b.get("fix") and cause != last_fix:
            lines.append(f"    fix: {b['fix']}")
        last_fix = cause
    lines.append(f"  lost: {cost_text(summary['lost_seconds'], summary['lost_tokens'])}"
                 + (" (give --prefill-rate TOK_PER_S to price it in seconds)" if summary["lost_seconds"] is None else ""))
    lines.append(f"  details: prefixtrace export {summary['db']} --session {summary['session']} --out session.jsonl "
                 "&& prefixtrace analyze session.jsonl")
    return "\n".join(lines)


def run(harness: str, args: Sequence[str], *, url: str = DEFAULT_URL, db: Path = Path("prefixtrace.db"),
        serve_args: Sequence[str] = (), model: str | None = None, prefill_rate: float | None = None,
        executable: str | None = None, session: str | None = None, url_given: bool = False,
        say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> int:
    """Run `harness` with `args` through a proxy; returns the harness's exit code."""
    name = harnesses.ALIASES.get(harness, harness)
    if name not in harnesses.HARNESSES:
        raise RunError(f"unknown harness {harness!r}; known: {', '.join(harnesses.HARNESSES)}")
    exe = shutil.which(executable or harnesses.HARNESSES[name][0])  # before any proxy is started
    if exe is None and executable:
        raise RunError(f"--exe {executable!r} is not an executable file")
    if exe is None:
        raise RunError(f"{harnesses.HARNESSES[name][0]!r} is not on PATH; install it or give --exe PATH")
    session = session or new_session_id(name)
    db = Path(db).resolve()
    scratch = Path(tempfile.mkdtemp(prefix=f"prefixtrace-run-{name}-"))
    tail: collections.deque = collections.deque(maxlen=8)
    reaper = Reaper(scratch)  # stops what run started and removes scratch (its keys) if run is killed
    proxy = None
    try:
        proxy = find_or_start_proxy(url, db, serve_args, scratch, say, url_given=url_given, reaper=reaper)
        db = proxy.db or db
        engine = "engine" in proxy.health
        target = harnesses.Target(base_url=f"{proxy.url}/s/{session}",
                                  model=model or served_model(proxy),
                                  pin_model=engine or model is not None,
                                  context_tokens=proxy.context_tokens)
        launch = harnesses.configure(name, target, scratch / "config")
        env = {**os.environ, **launch.env}
        say(f"session {session}: {name} -> {target.base_url}")
        code = run_harness([exe, *launch.args, *args], env, reaper, tail)
    finally:
        if proxy is not None:
            proxy.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        reaper.done()
    summary = summarize(db, session, prefill_rate)
    summary.update(harness=name, exit_code=code, last_lines=list(tail))
    say(format_summary(summary))
    return code

"""What the harness conformance tests share: pinned installs (cached between runs), real
`prefixtrace serve` processes, one harness run in a scratch directory, and reading back what the
proxy recorded (through `prefixtrace export`, the way a user would).

Nothing here stands in for a part under test: the harnesses are the registries' own packages, the
servers are `python -m prefixtrace.cli serve` subprocesses on the bundled SmolLM2, and the model
produces every tool call itself (`--tool-choice-default required-after-user` constrains *that* it
calls a tool after a user turn, never which tool or with what arguments).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]

# The versions the suite is written against (docs/HARNESSES.md). Changing one re-installs: the cache
# directory is keyed by the whole list.
NPM_PINS = {
    "pi": ("@mariozechner/pi-coding-agent", "0.73.1"),
    "claude": ("@anthropic-ai/claude-code", "2.1.197"),
    "codex": ("@openai/codex", "0.171.0"),
    "opencode": ("opencode-ai", "1.18.33"),
    "qwen": ("@qwen-code/qwen-code", "0.15.10"),
}
# harness name -> (PyPI package, version); each gets its own venv, its executable is named like the harness
PYPI_PINS = {"llm": ("llm", "0.36"), "aider": ("aider-chat", "0.86.2")}

INSTALL_TIMEOUT_S = 900
SERVER_START_TIMEOUT_S = 300

OPT_OUT_ENV = "PREFIXTRACE_HARNESS"  # "0": skip the harness suite (documented in docs/HARNESSES.md)
CACHE_ENV = "PREFIXTRACE_HARNESS_CACHE"


class HarnessUnavailable(RuntimeError):
    """A pinned harness could not be installed or does not run; the suite fails loudly on it."""


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "prefixtrace-harness")


def _key(pins: dict, extra: str) -> str:
    text = json.dumps(sorted(pins.items())) + extra
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@contextmanager
def _locked(path: Path):
    """One installer at a time per cache directory (CI machines may run two sessions)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run_install(cmd: list[str], log: Path, env: dict | None = None) -> None:
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S, env=env)
        except FileNotFoundError as exc:
            raise HarnessUnavailable(f"{cmd[0]} is not installed ({exc}); set {OPT_OUT_ENV}=0 to skip the harness suite")
        except subprocess.TimeoutExpired:
            raise HarnessUnavailable(f"{' '.join(cmd)} ran past {INSTALL_TIMEOUT_S} s (log: {log})")
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise HarnessUnavailable(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")


@dataclass
class Installed:
    bin: dict[str, Path]  # harness name -> executable
    seconds: dict[str, float] = field(default_factory=dict)  # what this session spent installing (0: cached)


def install_npm_harnesses() -> tuple[dict[str, Path], float]:
    """npm-install every pinned harness into one prefix under the cache, once per pin set.

    A prefix counts as installed only once `installed.json` is written after a successful
    install and version check, so an interrupted install is redone, not trusted."""
    node = subprocess.run(["node", "--version"], capture_output=True, text=True) if shutil.which("node") else None
    if node is None or node.returncode != 0 or shutil.which("npm") is None:
        raise HarnessUnavailable(f"node and npm are needed for the harness suite; set {OPT_OUT_ENV}=0 to skip it")
    major = node.stdout.strip().lstrip("v").split(".")[0]
    prefix = cache_root() / f"npm-{_key(NPM_PINS, 'node' + major)}"
    marker = prefix / "installed.json"
    spent = 0.0
    with _locked(prefix.with_suffix(".lock")):
        if not marker.exists():
            shutil.rmtree(prefix, ignore_errors=True)
            prefix.mkdir(parents=True)
            start = time.monotonic()
            specs = [f"{pkg}@{ver}" for pkg, ver in NPM_PINS.values()]
            _run_install(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                          "--loglevel=error", *specs], prefix / "install.log")
            spent = time.monotonic() - start
            marker.write_text(json.dumps({"pins": NPM_PINS, "node": major, "seconds": round(spent, 1)}))
    bins = {name: prefix / "node_modules" / ".bin" / exe
            for name, exe in {"pi": "pi", "claude": "claude", "codex": "codex", "opencode": "opencode",
                              "qwen": "qwen"}.items()}
    for name, path in bins.items():
        _check_version(name, path, NPM_PINS[name][1])
    return bins, spent


def install_pypi(name: str) -> tuple[Path, float]:
    """A PyPI harness (llm, aider) in its own virtual environment: its plugins and dependencies
    (aider pins ~100 packages, ~700 MB) stay out of the project's. Bounded by INSTALL_TIMEOUT_S."""
    pkg, ver = PYPI_PINS[name]
    venv = cache_root() / f"venv-{pkg}-{ver}-py{sys.version_info.major}{sys.version_info.minor}"
    marker = venv / "installed.json"
    spent = 0.0
    with _locked(venv.with_suffix(".lock")):
        if not marker.exists():
            shutil.rmtree(venv, ignore_errors=True)
            start = time.monotonic()
            venv.parent.mkdir(parents=True, exist_ok=True)
            _run_install([sys.executable, "-m", "venv", str(venv)], venv.parent / f"{venv.name}.venv.log")
            _run_install([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                          f"{pkg}=={ver}"], venv / "install.log")
            spent = time.monotonic() - start
            marker.write_text(json.dumps({"pin": f"{pkg}=={ver}", "seconds": round(spent, 1)}))
    exe = venv / "bin" / name
    _check_version(name, exe, ver)
    return exe, spent


def install_llm() -> tuple[Path, float]:
    return install_pypi("llm")


def _check_version(name: str, exe: Path, want: str) -> None:
    try:
        out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "HOME": str(cache_root())})
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        raise HarnessUnavailable(f"{name} ({exe}) does not run: {exc}")
    if want not in out.stdout + out.stderr:
        raise HarnessUnavailable(f"{name} --version says {(out.stdout + out.stderr).strip()!r}, pinned {want}")


# --- servers -------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A `prefixtrace serve` subprocess: where it listens and where it records."""
    url: str
    db: Path
    log: Path
    proc: subprocess.Popen

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


def server_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXTRACE_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def start_server(workdir: Path, name: str, args: list[str]) -> Server:
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    db = workdir / f"{name}.db"
    log = workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "prefixtrace.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--db", str(db), *args]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=server_env(),
                            cwd=workdir, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", db, log, proc)
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"{name} did not become healthy in {SERVER_START_TIMEOUT_S} s:\n{server.log_tail()}")
        time.sleep(0.5)


def stop_server(server: Server) -> None:
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)


# --- one harness run -----------------------------------------------------------------------------


@dataclass
class Scratch:
    """A harness's world: its own HOME and a working directory holding one file to read."""
    home: Path
    work: Path
    secret: str  # only the file holds it: seeing it in a request proves the tool ran

    @property
    def hello(self) -> Path:
        return self.work / "hello.txt"


def make_scratch(base: Path) -> Scratch:
    home, work = base / "home", base / "work"
    home.mkdir(parents=True)
    work.mkdir(parents=True)
    secret = f"pineapple-{uuid.uuid4().hex[:8]}"
    (work / "hello.txt").write_text(f"The secret word is {secret}.\n")
    return Scratch(home, work, secret)


def point(name: str, scratch: Scratch, base_url: str, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Harness `name` pointed at `base_url` by the product's own code (prefixtrace/harnesses.py, what
    `prefixtrace run` uses), with SmolLM2's context and a 200-token output cap: the arguments to put
    before the harness's own, and `env` with its variables added. Its files go beside the scratch HOME."""
    from prefixtrace import harnesses

    target = harnesses.Target(base_url=base_url, model="default", context_tokens=8192, max_output_tokens=200)
    launch = harnesses.configure(name, target, scratch.home.parent / "prefixtrace-config", env)
    return launch.args, {**env, **launch.env}


def harness_env(scratch: Scratch, extra: dict[str, str]) -> dict[str, str]:
    """A minimal environment: no host credentials, config or proxies leak into a harness."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TZ", "SYSTEMROOT")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(HOME=str(scratch.home), XDG_CONFIG_HOME=str(scratch.home / ".config"),
               XDG_DATA_HOME=str(scratch.home / ".local" / "share"),
               XDG_CACHE_HOME=str(scratch.home / ".cache"), XDG_STATE_HOME=str(scratch.home / ".local" / "state"),
               NO_COLOR="1", CI="1", DO_NOT_TRACK="1", NO_PROXY="127.0.0.1,localhost")
    env.update(extra)
    return env


@dataclass
class RunResult:
    cmd: list[str]
    returncode: int
    output: str
    seconds: float


def run_harness(cmd: list[str], scratch: Scratch, env: dict[str, str], timeout: float) -> RunResult:
    start = time.monotonic()
    proc = subprocess.Popen([str(c) for c in cmd], cwd=scratch.work, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[harness test: killed after {timeout} s]"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return RunResult([str(c) for c in cmd], proc.returncode, out, time.monotonic() - start)


# --- what was recorded ---------------------------------------------------------------------------


def export_records(db: Path, out: Path) -> list[dict]:
    """Every recorded turn, through `prefixtrace export` (the user's way out of the database)."""
    proc = subprocess.run([sys.executable, "-m", "prefixtrace.cli", "export", str(db), "--format", "jsonl",
                           "--out", str(out)], capture_output=True, text=True, env=server_env(), timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"prefixtrace export failed: {proc.stderr}")
    from recorder.renderers import RECORD_KEY

    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return [r for r in lines if RECORD_KEY not in r]  # the renderer's own line (docs/FORMATS.md) is no turn


def call_name(call: dict) -> str | None:
    """A recorded tool call's name, OpenAI-shaped ({function: {name}}) or flat ({name})."""
    return (call.get("function") or {}).get("name") or call.get("name")


def call_id(call: dict) -> str | None:
    return call.get("id") or call.get("call_id")


def tool_results(request: dict) -> list[tuple[str | None, str]]:
    """(call id, result text) of every tool result a request carries, in any of the three protocols."""
    found = []
    for msg in request.get("messages") or []:  # chat completions and Messages
        if not isinstance(msg, dict):
            continue
        if msg.get("role") == "tool":
            found.append((msg.get("tool_call_id"), json.dumps(msg.get("content"))))
        content = msg.get("content")
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    found.append((block.get("tool_use_id"), json.dumps(block.get("content"))))
    items = request.get("input")
    if isinstance(items, list):  # Responses
        for item in items:
            if isinstance(item, dict) and item.get("type") == "function_call_output":
                found.append((item.get("call_id"), json.dumps(item.get("output"))))
    return found


def assert_tool_round_trip(records: list[dict], scratch: Scratch, tool_names: set[str]) -> dict:
    """The model called one of `tool_names`, the harness ran it on the scratch file, and sent the
    file's secret back as that call's result. Returns the recorded call."""
    calls = {}
    for rec in records:
        for call in rec["response"].get("tool_calls") or []:
            calls[call_id(call)] = (rec, call)
    assert calls, "no recorded turn carries a tool call:\n" + describe(records)
    for rec in records:
        for cid, text in tool_results(rec["request"]):
            if scratch.secret in text:
                assert cid in calls, f"tool result for call {cid!r} matches no recorded call {sorted(calls)}"
                call = calls[cid][1]
                assert call_name(call) in tool_names, f"{call_name(call)} not among {tool_names}"
                return call
    raise AssertionError(f"no request carries a tool result holding {scratch.secret!r}:\n" + describe(records))


def assert_recorded_calls_match_what_client_saw(records: list[dict]) -> None:
    """Each tool call a harness echoes back in a later request was recorded on the turn that
    returned it, with the same name and arguments (what is recorded is what the client saw)."""
    recorded = {}
    for rec in records:
        for call in rec["response"].get("tool_calls") or []:
            recorded[call_id(call)] = call
    for rec in records:
        for echoed in echoed_calls(rec["request"]):
            cid, name, args = echoed
            assert cid in recorded, f"the harness sent back call {cid!r} ({name}) that no turn recorded"
            call = recorded[cid]
            assert call_name(call) == name
            assert call_args(call) == args, f"call {cid}: recorded {call_args(call)!r}, client echoed {args!r}"


def _parse(args):
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def call_args(call: dict):
    if "function" in call:
        return _parse(call["function"].get("arguments"))
    return _parse(call.get("input", call.get("arguments")))


def echoed_calls(request: dict) -> list[tuple[str | None, str | None, object]]:
    """(id, name, arguments) of every earlier tool call a request replays as history."""
    out = []
    for msg in request.get("messages") or []:
        if not isinstance(msg, dict) or msg.get("role") != "assistant":
            continue
        for call in msg.get("tool_calls") or []:
            out.append((call.get("id"), call_name(call), _parse((call.get("function") or {}).get("arguments"))))
        if isinstance(msg.get("content"), list):
            for block in msg["content"]:
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    out.append((block.get("id"), block.get("name"), block.get("input")))
    for item in request.get("input") or [] if isinstance(request.get("input"), list) else []:
        if isinstance(item, dict) and item.get("type") == "function_call":
            out.append((item.get("call_id"), item.get("name"), _parse(item.get("arguments"))))
    return out


def run_check(records: list[dict], path: Path) -> subprocess.CompletedProcess:
    """`prefixtrace check` over these records (a JSONL file, as a harness author's CI would)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", "check", str(path)], capture_output=True,
                          text=True, env=server_env(), timeout=600)


def describe(records: list[dict]) -> str:
    lines = []
    for rec in records:
        resp = rec["response"]
        lines.append(f"  {rec['endpoint']} session={rec['session']} status={resp.get('status')} "
                     f"finish={resp.get('finish_reason')} calls={resp.get('tool_calls')} "
                     f"error={resp.get('error')!r} text={resp.get('text', '')[:100]!r}")
    return "\n".join(lines) or "  (nothing recorded)"

"""The files one chat request walks through on the embedded engine, measured: `python -m testsupport.request_walk`.

What is counted (docs/ARCHITECTURE.md, "The path of one request"):
- a project file is one under proxy/, recorder/, analyzer/, engine/ or prefixtrace/ (prefixtrace/common and
  prefixtrace/wire included); libraries, tests and testsupport are not;
- a file is *touched* when a function defined in it starts running for this request, on any thread: the
  server's event loop, the engine thread's scheduler, a worker thread rendering the prompt, the recorder's
  writer. A generator or coroutine counts when it starts, not each time it resumes;
- the way *in* ends when the first reply bytes reach uvicorn (the first non-empty `http.response.body` sent:
  the response head goes out with them, proxy/connections.py); what starts later is on the way *out*;
- a file is *entered* when one of its functions starts and the nearest project function below it on that
  thread's stack is in another file (or there is none: the event loop, a new thread, a new task). A function
  called directly by a project function that began before the window (a thread's own loop: the engine's
  `_serve`, the recorder's writer) has that function's file as its caller. A file's first
  entry names its caller; an entry on the way in from any other caller is a *re-entry*: a round trip back
  into a module already left, or a second door into it. Calls from the same caller again are not.

The server is `prefixtrace serve` itself (prefixtrace/serve.py `serve`) on the tiny fixture model, run on this
process's main thread; a client thread sends the requests. Startup is excluded: the profiler is installed
before the server starts (so every thread it starts inherits it) but records nothing until the model is
loaded and one non-streamed and one streamed request have warmed every path up. Each request is recorded
in a window of its own, closed once nothing project-side has run for a moment after the reply (work a
reply leaves for the loop's next turn, the recorder's taps, included); the warm-up's windows are dropped,
so a measured window opens on a quiet server.
Python 3.11 has no sys.monitoring: sys.setprofile/threading.setprofile it is, and a generator's fresh start
is told from a resume by its frame standing at the code's first RESUME instruction.
"""

from __future__ import annotations

import argparse
import dis
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from testsupport.servers import ROOT, TINY_MODEL, free_port, wait_healthy

PROJECT_DIRS = ("proxy", "recorder", "analyzer", "engine", "prefixtrace")
_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
_UVICORN_HTTP = os.sep + os.path.join("uvicorn", "protocols", "http") + os.sep
QUIET_S = 0.4  # a window closes once no project function has started for this long after the reply
WINDOW_LIMIT_S = 10.0


@dataclass
class Entry:
    file: str
    caller: str  # the project file below it, or "(thread name)" when none is
    function: str
    thread: str
    way: str  # "in" or "out"


@dataclass
class FileWalk:
    file: str
    way: str  # the way it was first touched on
    caller: str
    function: str
    thread: str
    reentries_in: list[str] = field(default_factory=list)  # "caller (function)": other callers on the way in
    entries_out: int = 0  # entries after the first reply byte (any caller)


class WalkTracer:
    """A profile function that records project-file entries while a window is open."""

    def __init__(self, root: Path = ROOT):
        self._prefixes = tuple(str(root / d) + os.sep for d in PROJECT_DIRS)
        self._root = str(root) + os.sep
        self._files: dict[str, str | None] = {}
        self._first_resume: dict[object, int] = {}
        self._open = False
        self._out = False
        self._started: set[int] = set()  # frames started in this window (ids: frames on a stack stay alive)
        self.entries: list[Entry] = []
        self.touched: dict[str, Entry] = {}
        self.last_start = 0.0

    def install(self) -> None:
        sys.setprofile(self._on_event)
        threading.setprofile(self._on_event)

    def uninstall(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)

    def open_window(self) -> None:
        self.entries, self.touched, self._out, self._started = [], {}, False, set()
        self.last_start = time.monotonic()
        self._open = True

    def close_window(self) -> None:
        self._open = False

    def _file(self, filename: str) -> str | None:
        rel = self._files.get(filename, "")
        if rel == "":
            rel = filename[len(self._root):] if filename.startswith(self._prefixes) else None
            self._files[filename] = rel
        return rel

    def _fresh_start(self, frame) -> bool:
        code = frame.f_code
        if not code.co_flags & _GENERATOR_FLAGS:
            return True
        first = self._first_resume.get(code)
        if first is None:
            first = next(i.offset for i in dis.get_instructions(code) if i.opname == "RESUME")
            self._first_resume[code] = first
        return frame.f_lasti == first

    def _on_event(self, frame, event, arg) -> None:
        if event != "call" or not self._open:
            return
        code = frame.f_code
        if not self._out and code.co_name == "send" and _UVICORN_HTTP in code.co_filename:
            message = frame.f_locals.get("message") or {}
            if message.get("type") == "http.response.body" and message.get("body"):
                self._out = True
            return
        rel = self._file(code.co_filename)
        if rel is None or not self._fresh_start(frame):
            return
        self.last_start = time.monotonic()
        self._started.add(id(frame))
        caller_frame = frame.f_back
        caller = None
        while caller_frame is not None:  # the nearest project function started for this request
            if id(caller_frame) in self._started:
                caller = self._file(caller_frame.f_code.co_filename)
                if caller is not None:
                    break
            caller_frame = caller_frame.f_back
        if caller is None and frame.f_back is not None:
            # Called straight from a project function that began before the window: a thread's own loop
            # (the engine's `_serve`, the recorder's writer) calling on in its own module is no entry.
            caller = self._file(frame.f_back.f_code.co_filename)
        thread = threading.current_thread().name
        entry = Entry(rel, caller or f"({thread})", code.co_qualname, thread, "out" if self._out else "in")
        self.touched.setdefault(rel, entry)
        if caller != rel:
            self.entries.append(entry)


def walk_of(tracer: WalkTracer) -> list[FileWalk]:
    """Files in the order first touched, with their callers on the way in and entries on the way out."""
    walks: dict[str, FileWalk] = {}
    for name, first in tracer.touched.items():
        walks[name] = FileWalk(name, first.way, first.caller, first.function, first.thread)
    for entry in tracer.entries:
        walk = walks[entry.file]
        if entry.way == "out":
            walk.entries_out += 1
        elif entry.caller != walk.caller and not any(r.startswith(entry.caller + " ") for r in walk.reentries_in):
            walk.reentries_in.append(f"{entry.caller} ({entry.function})")
    return list(walks.values())


CONVERSATION = [
    {"role": "system", "content": "You are a careful coding assistant. Answer briefly."},
    {"role": "user", "content": "Write a haiku about caches."},
]
WARM_UP = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Say hello."},
]


def _chat(client: httpx.Client, messages: list[dict], *, stream: bool) -> None:
    body = {"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            text = b"".join(r.iter_bytes())
        if not text.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"the stream did not end with [DONE]: {text[-200:]!r}")
    else:
        r = client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        r.json()["choices"][0]["message"]


def _measured(tracer: WalkTracer, send) -> list[FileWalk]:
    tracer.open_window()
    send()
    deadline = time.monotonic() + WINDOW_LIMIT_S
    while time.monotonic() - tracer.last_start < QUIET_S and time.monotonic() < deadline:
        time.sleep(0.05)
    tracer.close_window()
    return walk_of(tracer)


def measure() -> dict[str, list[FileWalk]]:
    """Start `prefixtrace serve` on the tiny model here, warm it up, then walk one non-streamed and one
    streamed chat completion. Must run on the main thread (serve's SIGTERM handling)."""
    from prefixtrace.serve import ServeConfig, serve

    work = Path(tempfile.mkdtemp(prefix="request-walk-"))
    port = free_port()
    config = ServeConfig(port=port, db=work / "walk.db", model=TINY_MODEL, dtype="float32")
    tracer = WalkTracer()
    results: dict[str, list[FileWalk]] = {}
    failures: list[BaseException] = []

    def client() -> None:
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, None, "serve", 120)
            with httpx.Client(base_url=url, timeout=60) as http:
                for stream in (False, True):  # walked and dropped: each window opens on a quiet server
                    _measured(tracer, lambda: _chat(http, WARM_UP, stream=stream))
                results["chat, not streamed"] = _measured(tracer, lambda: _chat(http, CONVERSATION, stream=False))
                results["chat, streamed"] = _measured(tracer, lambda: _chat(http, CONVERSATION, stream=True))
        except BaseException as exc:  # re-raised on the main thread
            failures.append(exc)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # serve stops as it does on SIGTERM

    stdout = sys.stdout
    sys.stdout = sys.stderr  # uvicorn's access lines; stdout is the walk's
    tracer.install()
    try:
        threading.Thread(target=client, name="walk-client", daemon=True).start()
        serve(config)
    finally:
        tracer.uninstall()
        sys.stdout = stdout
    if failures:
        raise failures[0]
    return results


@dataclass(frozen=True)
class Figures:
    """What docs/ARCHITECTURE.md states of one walk (tests/test_request_walk.py compares them)."""

    files: int
    way_in: int  # files first touched before the first reply byte
    way_out: int  # files touched only after it
    reentered: int  # files entered again on the way in, from another caller than the first

    @property
    def target_met(self) -> bool:
        """Issue 36's target: within 12 files, each entered once on the way in."""
        return self.files <= 12 and self.reentered == 0


def figures_of(walks: list[FileWalk]) -> Figures:
    way_in = sum(w.way == "in" for w in walks)
    return Figures(len(walks), way_in, len(walks) - way_in, sum(bool(w.reentries_in) for w in walks))


def print_walk(name: str, walks: list[FileWalk]) -> None:
    f = figures_of(walks)
    print(f"{name}: {f.files} files ({f.way_in} on the way in, {f.way_out} only on the way out; "
          f"{f.reentered} re-entered on the way in)")
    print(f"  {'#':>2} {'file':<32} {'way':<4} {'thread':<18} {'first entered from':<30} {'function':<40} "
          "re-entered on the way in from")
    for i, w in enumerate(walks, 1):
        again = ", ".join(w.reentries_in) or "-"
        print(f"  {i:>2} {w.file:<32} {w.way:<4} {w.thread[:18]:<18} {w.caller:<30} {w.function[:40]:<40} {again}"
              f"{f'  (out: {w.entries_out} entries)' if w.entries_out else ''}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the walk here as JSON")
    args = parser.parse_args(argv)
    results = measure()
    for name, walks in results.items():
        print_walk(name, walks)
        print()
    if args.json:
        args.json.write_text(json.dumps({k: [asdict(w) for w in v] for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

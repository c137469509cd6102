"""A chat template rendered in a child process with a time, output and memory bound.

The analyzer renders templates it did not write: recorded in a database someone handed over,
published on an upstream's `/props`, or given with `--template`. In the analyzer's own process a
looping template would keep `analyze` or `check` (the CI gate) running for good and a big string
would take gigabytes; jinja2's sandbox stops a template from reaching Python, not from looping or
allocating. So every render goes to one long-lived child per template (analyzer/template_child.py,
the same sandboxed environment), under an address-space rlimit, with its output counted as it is
produced and a wall-clock deadline per render: past it the child is killed and the template is
marked spent, so later renders fail at once instead of each waiting out the deadline. One process
per template, not per render: a render is a few milliseconds, a process start a tenth of a second.
(engine/template_sandbox.py bounds a client's template the same way, one process per request.)
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
import weakref
from pathlib import Path
from typing import Any

from prefixtrace.common.errors import InvalidRequest

RENDER_TIMEOUT_S = 5.0  # one render; a real template renders a long session in milliseconds
START_TIMEOUT_S = 15.0  # the child's start and the template's compile (a loaded machine is slow to start)
MEMORY_BYTES = 1 << 30  # the child's address space
MAX_OUTPUT_CHARS = 64 << 20  # as a rebuilt body (recorder/rows.py MAX_BODY_CHARS): no prompt is longer
_CHILD = Path(__file__).with_name("template_child.py")


class TemplateBudgetError(InvalidRequest):
    """The template broke its time, output or memory bound, or its process died."""


class TemplateWorker:
    """Renders one template, `render(context) -> text`, in its bounded child process."""

    def __init__(self, source: str, name: str):
        self.name = name
        self._source = source
        self._spent: str | None = None  # why later renders fail at once
        self._proc: subprocess.Popen | None = None
        self._buffer = b""
        self._lock = threading.RLock()  # one job at a time on the pipe (the dashboard analyses in threads)
        self._start()

    def _start(self) -> None:
        limits = json.dumps({"memory": MEMORY_BYTES, "chars": MAX_OUTPUT_CHARS})
        self._proc = subprocess.Popen([sys.executable, "-I", str(_CHILD), limits], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self._finalizer = weakref.finalize(self, _stop, self._proc, os.getpid())
        self._pid = os.getpid()
        self._buffer = b""
        self._sent_messages: list = []  # the messages the child holds (the objects, compared by identity)
        self._sent_rest: dict[str, str] = {}  # the rest of the context the child holds, as JSON text
        reply = self._ask({"template": self._source}, START_TIMEOUT_S, "start")
        if "error" in reply:
            self.close()
            raise InvalidRequest(f"cannot load chat template {self.name}: {reply['error'][:300]}")

    def render(self, context: dict[str, Any], generations: tuple[bool, ...] = (False,)) -> list[dict[str, Any]]:
        """One reply per `add_generation_prompt` value (one round trip for both): {"text": …} or
        {"error": …, "raised": bool}. TemplateBudgetError when the template broke a bound now or before."""
        with self._lock:
            return self._render(context, generations)

    def _render(self, context: dict[str, Any], generations: tuple[bool, ...]) -> list[dict[str, Any]]:
        if self._spent:
            raise TemplateBudgetError(self._spent)
        if self._proc is not None and self._pid != os.getpid():
            # A forked process (the analyzer's per-session workers) inherited the parent's child and its
            # pipes: talking over them would mix two processes' jobs, so it starts a child of its own.
            self._finalizer.detach()
            self._proc = None
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        # Only what changed since the last render crosses the pipe: a session's next turn repeats the
        # previous one's messages (the same skeleton objects: analyzer/render.py) and its tools.
        messages, rest = context["messages"], {k: v for k, v in context.items() if k != "messages"}
        keep, sent = 0, self._sent_messages
        for keep in range(min(len(sent), len(messages)) + 1):
            if keep == len(sent) or keep == len(messages) or sent[keep] is not messages[keep]:
                break
        # Compared as JSON text, not with ==: two dicts with their keys in another order are equal, but a
        # template renders them differently (a serialization break the analysis must see).
        spelled = {k: json.dumps(v) for k, v in rest.items()}
        job = {"keep": keep, "append": messages[keep:], "generations": generations,
               "set": {k: rest[k] for k, text in spelled.items() if self._sent_rest.get(k) != text},
               "unset": [k for k in self._sent_rest if k not in rest]}
        replies = self._ask(job, RENDER_TIMEOUT_S, "render")["replies"]
        self._sent_messages, self._sent_rest = list(messages), spelled
        return replies

    def _ask(self, job: dict, timeout_s: float, what: str) -> dict[str, Any]:
        proc = self._proc
        try:
            proc.stdin.write(json.dumps(job).encode("utf-8") + b"\n")
            proc.stdin.flush()
        except BrokenPipeError:
            return self._fail(f"the chat template {self.name}'s render process ended")
        line = self._read_line(timeout_s)
        if line is None:
            if proc.poll() is None:
                return self._fail(f"the chat template {self.name} did not {what} within {timeout_s:g} s")
            return self._fail(f"the chat template {self.name}'s render process ended (it may have needed more "
                              f"than {MEMORY_BYTES >> 20} MiB)")
        reply = json.loads(line)
        if reply.get("bound"):  # memory or output: a bound every later render would break too
            self._fail(f"the chat template {self.name} failed: {reply['error']}")
        return reply

    def _read_line(self, timeout_s: float) -> bytes | None:
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _fail(self, why: str):
        self._spent = f"{why}; its renders are skipped"
        self.close()
        raise TemplateBudgetError(self._spent)

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._finalizer()
                self._proc = None


def _stop(proc: subprocess.Popen, owner_pid: int) -> None:
    """Ends the child (a finalizer: it must not refer to the worker); only in the process that started it."""
    if os.getpid() != owner_pid:
        return
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


_SHARED: OrderedDict[tuple[str, str], TemplateWorker] = OrderedDict()
_SHARED_MAX = 8
_shared_lock = threading.Lock()


def shared_worker(source: str, name: str) -> TemplateWorker:
    """The worker for `source`, shared by every renderer of the same template in this process (a
    process start costs more than many renders); the least recently used past _SHARED_MAX is closed
    (a renderer still holding it restarts it on its next render)."""
    key = (source, name)
    with _shared_lock:
        worker = _SHARED.pop(key, None)
        if worker is None:
            worker = TemplateWorker(source, name)
        _SHARED[key] = worker
        while len(_SHARED) > _SHARED_MAX:
            _SHARED.popitem(last=False)[1].close()
        return worker

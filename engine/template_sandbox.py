"""Render a client-supplied chat template (`chat_template_kwargs.chat_template`) within bounds.

Only with `serve --allow-client-templates`; otherwise such a request is refused
(engine/chat_render.py). A template is a program: jinja2's sandbox stops it
from reaching Python internals, but not from looping or allocating without
limit (`{{ 'a' * 10**9 }}`, a string doubled in a loop, `center(10**9)`), and
an in-process render cannot be stopped once it runs. So the render happens
in a short-lived child process with an address-space and CPU-time rlimit, a
wall-clock timeout and a cap on the text it may return: a hostile template
costs that child, never the server. The child renders the way transformers
does (ImmutableSandboxedEnvironment, trim_blocks/lstrip_blocks, loopcontrols,
`raise_exception`, `tojson`, `strftime_now`), written out here because
importing transformers in the child would cost seconds per request.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

from prefixtrace.common.errors import InvalidRequest

TIMEOUT_S = 10.0
MEMORY_BYTES = 256 << 20  # the child's address space, plus 8 bytes per byte of the request's JSON
MAX_TEXT_CHARS = 8 << 20  # far beyond any context window's worth of text

_CHILD = r"""
import json, resource, sys
limits = json.loads(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu"], limits["cpu"]))
from datetime import datetime
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

try:
    job = json.load(sys.stdin)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    out, size = [], 0
    for piece in env.from_string(job["template"]).generate(**job["context"]):
        out.append(piece)
        size += len(piece)
        if size > limits["chars"]:
            raise ValueError(f"the template's output passed {limits['chars']:,} characters")
    result = {"text": "".join(out)}
except MemoryError:
    result = {"error": f"the template needed more than {limits['memory'] >> 20} MiB"}
except Exception as exc:
    result = {"error": f"{type(exc).__name__}: {exc}"}
json.dump(result, sys.stdout)
"""


def render_client_template(template: str, context: dict[str, Any], *, timeout_s: float | None = None,
                           memory_bytes: int | None = None, max_chars: int | None = None) -> str:
    """The text `template` renders for `context` (JSON data: messages, tools, flags), or
    InvalidRequest naming the bound it broke or the error it raised. Bounds default to
    the module's TIMEOUT_S, MEMORY_BYTES and MAX_TEXT_CHARS."""
    timeout_s = timeout_s or TIMEOUT_S
    memory_bytes, max_chars = memory_bytes or MEMORY_BYTES, max_chars or MAX_TEXT_CHARS
    job = json.dumps({"template": template, "context": context})
    # The CPU limit is a backstop one second past the wall clock: the render is one thread, so its CPU
    # time never passes its wall time, and the wall clock's clear message wins. At an equal limit the
    # kernel's SIGKILL and the timeout raced (CI once saw "ended (-9)" for a template that spun).
    limits = json.dumps({"memory": memory_bytes + 8 * len(job), "cpu": math.ceil(timeout_s) + 1, "chars": max_chars})
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _CHILD, limits], input=job, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise InvalidRequest(f"the client's chat template did not finish rendering in {timeout_s:g} s",
                             param="chat_template_kwargs.chat_template") from None
    try:
        result = json.loads(done.stdout)
    except ValueError:  # killed by its CPU limit, or died another way
        result = {"error": f"the render process ended ({done.returncode}) without a result"}
    if "error" in result:
        raise InvalidRequest(f"the client's chat template failed: {result['error']}",
                             param="chat_template_kwargs.chat_template")
    return result["text"]

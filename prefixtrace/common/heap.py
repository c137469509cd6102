"""Giving the heap's free pages back to the operating system (glibc's `malloc_trim`).

glibc keeps freed heap memory for reuse and raises its mmap threshold to the largest block freed (up
to 32 MB), so after one big request (a 30 MB prompt: its body, the decoded text, the parsed JSON,
the recorder's row, ~30 MB each) the next big one is served from the heap too, and the process's
resident memory never comes down. The proxy trims after each big request (proxy/connections.py) and
the recorder after writing a big turn (recorder/store.py). The standard library has no binding for
it, hence ctypes; on a C library without it (musl, macOS) `trim_heap` does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util


def _libc_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to call
        return None


_malloc_trim = _libc_malloc_trim()
AVAILABLE = _malloc_trim is not None


def trim_heap() -> None:
    """Returns the heap's free pages to the OS now (a few ms; call it off the event loop)."""
    if _malloc_trim is not None:
        _malloc_trim(0)

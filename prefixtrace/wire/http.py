"""What every HTTP client of an OpenAI- or Anthropic-compatible server needs, whoever calls it
(the proxy's upstream backends, `prefixtrace replay`): httpx errors mapped into the error tree
in one place, and one spelling of a server's base URL."""

from __future__ import annotations

import contextlib

import httpx

from prefixtrace.common.errors import UpstreamError, UpstreamTimeout


@contextlib.contextmanager
def map_httpx_errors(url: str):
    """Translate httpx's exceptions into the prefixtrace tree, in one place."""
    try:
        yield
    except httpx.TimeoutException as exc:
        # Which limit it was (connect, first byte, idle: prefixtrace/config.py), when the client said.
        why = f": {exc}" if str(exc) and "timed out" not in str(exc).lower() else ""
        raise UpstreamTimeout(f"upstream {url} timed out: {type(exc).__name__}{why}", upstream=url) from exc
    except httpx.HTTPError as exc:
        raise UpstreamError(f"upstream {url} is unreachable: {type(exc).__name__}: {exc}", upstream=url) from exc


def normalize_base_url(url: str) -> str:
    """Accept `http://h:p`, `http://h:p/` or `http://h:p/v1`; return the part before /v1."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url

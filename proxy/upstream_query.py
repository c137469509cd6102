"""Query strings on the way upstream: an upstream URL's own (`?api-version=...`, Azure OpenAI's
habit) is sent with every request to it, and a client's query string with its turn; the upstream
URL's values stand where a client sends the same name. Values are never shown (they may be keys)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_VALUE = re.compile(r"=[^&]*")


def split_query(url: str) -> tuple[str, str]:
    """`url` without its query string (and fragment), and that query string."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(query="", fragment="")), parts.query


def merged(base: str, client: str) -> str:
    """`base`'s parameters, then the client's whose names `base` does not set."""
    if not client:
        return base
    taken = {p.split("=", 1)[0] for p in base.split("&") if p}
    extra = [p for p in client.split("&") if p and p.split("=", 1)[0] not in taken]
    return "&".join([*(p for p in base.split("&") if p), *extra])


def with_query(path: str, query: str) -> str:
    return f"{path}?{query}" if query else path


def masked(query: str) -> str:
    """`api-version=***&key=***`: the names, for labels and errors."""
    return _VALUE.sub("=***", query)

"""Upstream URLs that may carry credentials (`http://user:password@host`).

The credentials are for the upstream only: they go out as HTTP Basic auth on
each request and are never shown, logged, stored or exported. Everything that
names an upstream (labels, logs, errors sent to clients, the recorded turn,
metrics, the dashboard) uses `display_url`, which writes them as `***`; only
the HTTP client gets `without_credentials` plus `credentials`.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit


def _netloc_without_userinfo(netloc: str) -> tuple[str, str | None]:
    userinfo, at, hostport = netloc.rpartition("@")
    return (hostport, userinfo) if at else (netloc, None)


def display_url(url: str) -> str:
    """`url` with any user/password written as `***`: `http://***@host:8000/v1`."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an unclosed [IPv6 bracket: still never print what may be a password
        return "***" if "@" in url else url
    hostport, userinfo = _netloc_without_userinfo(parts.netloc)
    if userinfo is None:
        return url
    return urlunsplit(parts._replace(netloc="***@" + hostport))


def without_credentials(url: str) -> str:
    """`url` with no userinfo at all (what the HTTP client is given as its base URL)."""
    parts = urlsplit(url)
    hostport, _ = _netloc_without_userinfo(parts.netloc)
    return urlunsplit(parts._replace(netloc=hostport))


def credentials(url: str) -> tuple[str, str] | None:
    """(user, password) from `url`'s userinfo, percent-decoded; None when it has none."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return None
    return unquote(parts.username or ""), unquote(parts.password or "")

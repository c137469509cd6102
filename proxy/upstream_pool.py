"""Several upstreams behind one proxy, with session affinity, health checks and failover.

A session's requests go to the upstream that holds its prefix, so that
server's prefix cache stays warm. The session key is the request's session
id (X-Session-Id, `user`, `prompt_cache_key`, Anthropic `metadata.user_id`),
else a hash of the conversation's head: the leading system messages and the
first conversation message, which every turn of one conversation repeats.

Placement: a consistent-hash ring (`vnodes` points per upstream), so adding a
server moves about 1/N of the new sessions. Once placed, a session is pinned:
it stays where its cache is even when the ring changes, until that upstream
fails. Failover: an upstream that refuses a connection (or drops it before
answering) is marked down and the request is retried on the next healthy
upstream of the key's ring order; the session is re-pinned there and the
cache-affinity loss is logged and counted (`failovers`). A health check
(GET /v1/models every `health_interval` seconds) marks upstreams down and
back up. Only failures before any response byte are retried: a stream that
breaks midway has already reached the client.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

import httpx

from analyzer.canon import canonical_message, messages_of
from analyzer.causes import HEAD_ROLES
from proxy.upstream_timeouts import UpstreamTimeouts
from prefixtrace.common.errors import UpstreamError
from proxy.upstream_backend import UpstreamBackend

log = logging.getLogger("prefixtrace.upstreams")
# Failures that happen before the upstream answered: safe to send elsewhere.
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
MAX_PINS = 100_000


@dataclass
class Member:
    backend: UpstreamBackend
    up: bool = True
    requests: int = 0
    errors: int = 0
    failovers: int = 0  # sessions moved away from this upstream

    @property
    def url(self) -> str:
        return self.backend.base_url


def session_key(body: dict, session_id: str | None) -> str:
    """The affinity key: the session id, else a hash of the conversation's head."""
    if session_id:
        return "id:" + session_id
    head = []
    for message in messages_of(body):
        head.append(canonical_message(message))
        if not (isinstance(message, dict) and message.get("role") in HEAD_ROLES):
            break  # through the first conversation message
    digest = hashlib.sha256(json.dumps([body.get("model"), head], ensure_ascii=False).encode()).hexdigest()
    return "head:" + digest[:32]


class HashRing:
    """Consistent hashing: each URL owns `vnodes` points; a key walks clockwise."""

    def __init__(self, urls: list[str], vnodes: int = 64):
        points = sorted((_hash(f"{url}#{i}"), url) for url in urls for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._urls = [u for _, u in points]
        self.size = len(set(urls))

    def order(self, key: str) -> list[str]:
        """Every URL once, in the key's preference order."""
        out: list[str] = []
        start = bisect.bisect(self._hashes, _hash(key))
        for i in range(len(self._urls)):
            url = self._urls[(start + i) % len(self._urls)]
            if url not in out:
                out.append(url)
                if len(out) == self.size:
                    break
        return out


def _hash(value: str) -> int:
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "big")


class UpstreamPool:
    """Several OpenAI/Anthropic-compatible upstreams as one backend (the `UpstreamBackend` interface).

    Args:
        urls: base URLs (`http://h:p` or `http://h:p/v1`), at least one.
        health_interval: seconds between health checks.
        transport: injected httpx transport (tests).
        timeouts: each upstream's connect, first-byte and idle limits (prefixtrace/config.py); a
            timeout is no failover: the upstream may have started on the request.
    """

    max_context_tokens = None  # the upstreams' limits are their own
    embedded = False  # proxy/backend.py: bodies go on as sent

    def renderer_of(self, url: str):
        """The renderer the member at `url` published (None: none, or no such member)."""
        member = self.members.get(url)
        return member.backend.renderer_of(url) if member is not None else None

    def renderer_identity(self) -> None:
        return None

    def __init__(self, urls: list[str], *, health_interval: float = 2.0, vnodes: int = 64,
                 transport: httpx.AsyncBaseTransport | None = None, timeout: float | None = None,
                 timeouts: UpstreamTimeouts | None = None, probe_props: bool = False):
        if not urls:
            raise UpstreamError("an upstream pool needs at least one URL")
        members = [Member(UpstreamBackend(u, transport=transport, timeout=timeout, timeouts=timeouts,
                                          probe_props=probe_props)) for u in urls]
        self.members: dict[str, Member] = {m.url: m for m in members}
        self.ring = HashRing(list(self.members), vnodes)
        self.pins: OrderedDict[str, str] = OrderedDict()  # session key -> url, LRU
        self.health_interval = health_interval
        self._health_task: asyncio.Task | None = None

    @property
    def label(self) -> str:
        return "pool:" + ",".join(self.members)

    # --- health ------------------------------------------------------------------

    def _ensure_health_checks(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval)

    async def check_health(self) -> None:
        results = await asyncio.gather(*(m.backend.ready() for m in self.members.values()))
        for member, ok in zip(self.members.values(), results):
            if ok != member.up:
                log.warning("upstream %s is %s", member.url, "back up" if ok else "down (health check)")
            member.up = ok

    async def aclose(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        for member in self.members.values():
            await member.backend.aclose()

    async def ready(self) -> bool:
        self._ensure_health_checks()
        await self.check_health()
        return any(m.up for m in self.members.values())

    # --- routing -----------------------------------------------------------------

    def route(self, key: str) -> list[Member]:
        """Where `key` goes, best first: its pinned upstream if healthy, then its ring order (healthy first)."""
        order = [self.members[u] for u in self.ring.order(key)]
        pinned = self.pins.get(key)
        if pinned is not None:
            order.sort(key=lambda m: m.url != pinned)
        return sorted(order, key=lambda m: not m.up)  # stable: keeps the preference among equals

    def _pin(self, key: str, member: Member) -> None:
        previous = self.pins.get(key)
        if previous is not None and previous != member.url:
            self.members[previous].failovers += 1
            log.warning("session %s moved from %s to %s: cache affinity lost, its prefix is re-prefilled there",
                        key, previous, member.url)
        self.pins[key] = member.url
        self.pins.move_to_end(key)
        while len(self.pins) > MAX_PINS:
            self.pins.popitem(last=False)

    async def post(self, path: str, body: dict, headers: dict[str, str], *,
                   session_id: str | None = None, raw: bytes | None = None) -> tuple[httpx.Response, str]:
        """Send to the session's upstream; on a failure before any answer, the next one."""
        self._ensure_health_checks()
        key = session_key(body, session_id)
        last: UpstreamError | None = None
        for member in self.route(key):
            member.requests += 1
            try:
                response, url = await member.backend.post(path, body, headers, raw=raw)
            except UpstreamError as exc:
                if not isinstance(exc.__cause__, RETRYABLE):
                    raise
                member.errors += 1
                if member.up:
                    log.warning("upstream %s failed (%s); marked down, trying the next one", member.url, exc.message)
                member.up = False
                last = exc
                continue
            self._pin(key, member)
            return response, url
        raise UpstreamError(f"no upstream could take the request; last error: {last.message if last else 'none'}",
                            upstreams=list(self.members))


    # --- the rest of the backend interface ----------------------------------------

    def _healthy(self) -> list[Member]:
        return [m for m in self.members.values() if m.up] or list(self.members.values())

    async def models(self) -> dict:
        last = None
        for member in self._healthy():
            try:
                return await member.backend.models()
            except UpstreamError as exc:
                last = exc
        raise last

    async def capacity(self) -> dict:
        out = {}
        for member in self.members.values():
            try:
                out[member.url] = await member.backend.capacity()
            except UpstreamError as exc:
                out[member.url] = {"error": exc.message}
        return {"upstreams": out}

    def stats(self) -> list[dict]:
        pinned: dict[str, int] = {}
        for url in self.pins.values():
            pinned[url] = pinned.get(url, 0) + 1
        return [{"url": m.url, "up": m.up, "sessions": pinned.get(m.url, 0), "requests": m.requests,
                 "errors": m.errors, "failovers": m.failovers} for m in self.members.values()]

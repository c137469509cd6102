"""An upstream server as a backend (`proxy.backend.ForwardingBackend`): bodies POSTed as sent, over httpx
or the proxy's own client (proxy/upstream_http.py); each protocol adapter reads the reply (`Relayed`).

Streams are passed through event by event as they arrive (never buffered
whole); each event is also parsed so the turn can be recorded.

Whatever the upstream does, the client gets what it sent or an error in the API's shape that
names the upstream's fault, and the turn is recorded (issue 25): a success body that is not
JSON, or not the API's shape, is a 502 (`Relayed.read`, `Relayed.reading`); a streamed event the
proxy cannot read is passed on as it came and the turn records the fault (`Relayed.read_event`);
an upstream that does not connect, answer or keep sending within its timeouts
(`UpstreamTimeouts`) is a 504, or an error event once the stream's head went out.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
from typing import Any, AsyncIterator, Callable

import httpx

from proxy.upstream_timeouts import UpstreamTimeouts
from prefixtrace.common.errors import UpstreamError
from prefixtrace.common.urls import credentials, display_url, without_credentials
from proxy.upstream_query import masked, merged, split_query, with_query
from prefixtrace.wire.http import map_httpx_errors, normalize_base_url  # noqa: F401 (used here and by proxy/)
from prefixtrace.wire import sse
from prefixtrace.wire.dynamo_identity import PARENT_HEADER as DYNAMO_PARENT, SESSION_HEADER as DYNAMO_SESSION, \
    dynamo_identity
from proxy.relay import UPSTREAM_BODY
from proxy.reply_bounds import MAX_PROPS_BYTES, ReplyTooLarge, bounded, read_bounded
from proxy.upstream_http import WORKER_HEADER, UpstreamConnections
from recorder import renderers
from recorder.turn_facts import Fact, UpstreamFault

# Headers that describe one hop, not the request; httpx sets its own.
_HOP_HEADERS = {
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
    "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding", "x-session-id",
    "content-encoding",  # the body read here is the decoded one (proxy/request_limits.py)
    # The client's browser state and network path are not the upstream's business (issue 14).
    "cookie", "origin", "referer", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "forwarded",
    "x-real-ip",
}
# What httpx's client adds to a request that lacks them (the turn's POST skips the client: `_head`).
_DEFAULT_HEADERS = {"accept": b"*/*", "user-agent": f"python-httpx/{httpx.__version__}".encode()}
_NOT_IN_A_HEADER = re.compile("[\r\n\0]")
# The session id goes out as the routing key of the routers users put in front of a fleet, so a
# session's turns stay on the worker that holds its prefix (docs/FLEET.md): sglang-router's `manual`
# policy reads X-SMG-Routing-Key, vllm-router's `consistent_hash` and `sticky_least_loaded` X-Session-Id.
ROUTING_KEY_HEADERS = ("x-smg-routing-key", "x-session-id", "x-dynamo-session-id")
# What reading a reply of the wrong shape raises (a fact's reading, `ChatChunk.read`'s `ValueError`s, and the
# readers' `.get` on a string): the upstream's fault, not the proxy's.
UNREADABLE = (ValueError, TypeError, AttributeError, KeyError, IndexError)


class UpstreamBackend:
    """`probe_props`: before the first turn, ask once for the chat template the upstream publishes
    (`published_renderer`); `prefixtrace serve` turns it on, a scripted upstream in a test leaves it off."""

    def __init__(self, base_url: str, *, transport: httpx.AsyncBaseTransport | None = None,
                 timeout: float | None = None, timeouts: UpstreamTimeouts | None = None, probe_props: bool = False):
        """`timeouts`: connect, first-byte and idle limits (prefixtrace/config.py); `timeout`, when
        given instead, is both the first-byte and the idle limit."""
        if timeouts is None:
            timeouts = UpstreamTimeouts() if timeout is None else UpstreamTimeouts(first_byte_s=timeout, idle_s=timeout)
        self.timeouts = timeouts
        url, self.query = split_query(base_url)  # sent with every request (proxy/upstream_query.py)
        url = normalize_base_url(url)
        # `base_url` names the upstream everywhere (label, errors, the recorded turn):
        # its credentials, if any, only reach the client, as Basic auth (prefixtrace/common/urls.py).
        self.base_url = display_url(url) + (f"?{masked(self.query)}" if self.query else "")
        auth = credentials(url)
        self.client = httpx.AsyncClient(
            base_url=without_credentials(url),
            auth=auth,
            transport=transport,
            # The turn's POST keeps the first-byte limit around its head (`post`) and the idle one
            # between body reads (`_Paced`); httpx's own read limit is only the larger of the two.
            timeout=httpx.Timeout(_larger(timeouts.first_byte_s, timeouts.idle_s), connect=timeouts.connect_s,
                                  write=timeouts.idle_s),
        )
        # The turn's POST skips the client's send stack (see `_send`); it sends the same headers.
        self._auth_header = None if auth is None else \
            "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        self.connections = self._direct_connections(without_credentials(url), transport, timeouts)
        self._asked_props = not probe_props
        self.renderer: renderers.RendererInfo | None = None  # the template this upstream published (`published_renderer`)

    def _direct_connections(self, url: str, transport, timeouts: UpstreamTimeouts) -> UpstreamConnections | None:
        """The lean client for the turn's POST (proxy/upstream_http.py) where it can stand in for
        httpx's: plain http, no injected transport, no proxy from the environment for this URL
        (httpx would have sent through it), no query string to merge."""
        target = httpx.URL(url)
        pick = getattr(self.client, "_transport_for_url", None)
        if transport is not None or target.scheme != "http" or target.query or pick is None \
                or pick(target) is not getattr(self.client, "_transport", None):
            return None
        port = target.port or 80
        self._target_prefix = target.raw_path.rstrip(b"/")
        self._host = target.host.encode("idna") if target.port is None else \
            (f"[{target.host}]" if ":" in target.host else target.host).encode("idna") + b":%d" % port
        return UpstreamConnections(target.host, port, connect_timeout=timeouts.connect_s,
                                   read_timeout=timeouts.idle_s, write_timeout=timeouts.idle_s,
                                   first_byte_timeout=timeouts.first_byte_s)

    embedded = False  # proxy/backend.py: bodies go on as sent, replies are read on their way back

    @property
    def label(self) -> str:
        return self.base_url

    def renderer_identity(self) -> None:
        return None  # the upstream's template, where it publishes one, is read by `published_renderer`

    def renderer_of(self, url: str) -> renderers.RendererInfo | None:
        """The renderer of the upstream that answered at `url` (this one's, when it published one)."""
        return self.renderer if url == self.base_url else None

    def stats(self) -> None:
        return None  # one server: its counters are in the turns themselves

    async def aclose(self) -> None:
        if self.connections is not None:
            await self.connections.aclose()
        await self.client.aclose()

    async def ready(self) -> bool:
        try:
            response = await self.client.get(with_query("/v1/models", self.query), timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code < 500

    max_context_tokens = None  # an upstream's limits are its own (see its /v1/capacity, if any)

    async def capacity(self) -> dict:
        with map_httpx_errors(self.base_url):
            response = await self.client.get(with_query("/v1/capacity", self.query))
        if response.status_code >= 400:
            raise UpstreamError(f"upstream {self.base_url} has no capacity endpoint ({response.status_code})")
        return response.json()

    async def models(self) -> dict:
        with map_httpx_errors(self.base_url):
            response = await self.client.get(with_query("/v1/models", self.query))
        if response.status_code >= 400:
            raise UpstreamError(f"upstream {self.base_url} answered {response.status_code} to /v1/models")
        return response.json()

    async def published_renderer(self) -> None:
        """Asks once whether this upstream publishes its chat template (llama.cpp: GET /props
        `chat_template`, `bos_token`, `eos_token`), so its turns name the renderer that built their
        prompts (recorder/renderers.py). Absence, an error or a slow answer: nothing recorded."""
        if self._asked_props:
            return
        self._asked_props = True
        try:
            async with self.client.stream("GET", with_query("/props", self.query), timeout=3.0) as response:
                data = await read_bounded(response, MAX_PROPS_BYTES) if response.status_code == 200 else None
            props = json.loads(data) if data is not None else None
        except (httpx.HTTPError, ValueError, RecursionError):
            return
        template = props.get("chat_template") if isinstance(props, dict) else None
        # A template past the bound is none a server renders with: not recorded (recorder/renderers.py).
        if isinstance(template, str) and template and len(template) <= renderers.MAX_TEMPLATE_CHARS:
            name = props.get("model_alias") or str(props.get("model_path") or self.base_url).rsplit("/", 1)[-1]
            special = {k: props[k] for k in ("bos_token", "eos_token") if isinstance(props.get(k), str)}
            self.renderer = renderers.RendererInfo("upstream", str(name), template, special)

    async def post(self, path: str, body: dict, headers: dict[str, str], *,
                   session_id: str | None = None, raw: bytes | None = None) -> tuple[httpx.Response, str]:
        """POST `body` to `path` (with the client's query string, if any), response streamed; returns
        it with the URL that answered (`UpstreamPool` picks one of several by session; one upstream
        ignores `session_id`). `raw`: `body` as the client's bytes, sent as they are when they are
        plain UTF-8 JSON."""
        await self.published_renderer()
        path, client_query = split_query(path)
        path = with_query(path, merged(self.query, client_query))
        forward = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        if not any(k.lower() == "content-type" for k in forward):
            forward["content-type"] = "application/json"
        if session_id and not _NOT_IN_A_HEADER.search(session_id) and session_id.isascii():
            forward = {k: v for k, v in forward.items() if k.lower() not in ROUTING_KEY_HEADERS + (DYNAMO_PARENT,)}
            forward.update(dict.fromkeys(ROUTING_KEY_HEADERS, session_id))
            # Dynamo reads only its own headers once its session header is there: say the harness's
            # sub-agent identity in them, as Dynamo itself would have read it (docs/FLEET.md).
            identity = dynamo_identity(headers)
            if identity is not None:
                forward[DYNAMO_SESSION] = identity.session
                if identity.parent is not None:
                    forward[DYNAMO_PARENT] = identity.parent
        content = raw if raw is not None and plain_json_object(raw) else _json_bytes(body)
        with map_httpx_errors(self.base_url):
            if self.connections is not None:
                return await self.connections.request(self._head(path, forward, len(content)), content), self.base_url
            request = self.client.build_request("POST", path, content=content, headers=forward)
            started = asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout(self.timeouts.first_byte_s):
                    response = await self._send(request)
            except httpx.ConnectTimeout as exc:  # say which limit, as the lean client does
                raise httpx.ConnectTimeout(f"could not connect to the upstream within {self.timeouts.connect_s:g} s "
                                           "(connect timeout)") from exc
            except (httpx.ReadTimeout, TimeoutError) as exc:
                raise httpx.ReadTimeout(f"no reply from the upstream within {self.timeouts.first_byte_s:g} s "
                                        "(first-byte timeout)") from exc
            return _Paced(response, self.timeouts, started), self.base_url

    def _head(self, path: str, headers: dict[str, str], length: int) -> bytes:
        """The request line and headers for `_direct_connections`: what httpx would have sent (its
        defaults where the client sent none, the credentials' Basic header), asking for no compression."""
        if _NOT_IN_A_HEADER.search(path) or " " in path:
            raise httpx.LocalProtocolError("the request target holds a space, line break or NUL")
        lines = [b"POST " + self._target_prefix + path.encode() + b" HTTP/1.1\r\nhost: " + self._host]
        seen = set()
        for name, value in headers.items():
            name = name.lower()
            if name == "authorization" and self._auth_header is not None:
                continue  # the upstream URL's credentials stand in for the client's
            if _NOT_IN_A_HEADER.search(name) or _NOT_IN_A_HEADER.search(value):
                raise httpx.LocalProtocolError(f"header {name!r} holds a line break or NUL")
            seen.add(name)
            lines.append(name.encode("latin-1") + b": " + value.encode("latin-1"))
        for name, value in _DEFAULT_HEADERS.items():
            if name not in seen:
                lines.append(name.encode() + b": " + value)
        if self._auth_header is not None:
            lines.append(b"authorization: " + self._auth_header.encode())
        lines.append(b"accept-encoding: identity\r\ncontent-length: %d\r\n\r\n" % length)
        return b"\r\n".join(lines)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """`client.send(request, stream=True)` without the client's own layers around the transport:
        auth flow, redirect and cookie handling, its response stream wrapper and its per-request INFO
        log line were a fifth of the proxy's CPU on a short streamed turn (issue 17). A turn's POST
        needs none of them: the credentials are one fixed Basic header, redirects are not followed
        (the client's default too), and the upstream's cookies are not kept (the proxy serves many
        clients; a cookie one answer sets is no other request's). The transport is the one the client
        would have picked for the URL (its connection pool, or a proxy from the environment); the
        health checks and /v1/models still go through the client, and are still logged."""
        pick = getattr(self.client, "_transport_for_url", None)  # httpx >= 0.18; else the plain way
        if pick is None:
            return await self.client.send(request, stream=True)
        if self._auth_header is not None:
            request.headers["Authorization"] = self._auth_header
        response = await pick(request.url).handle_async_request(request)
        response.request = request
        return response


def plain_json_object(raw: bytes) -> bool:
    """Whether `raw` (a body that parsed as a JSON object) is UTF-8 with no byte-order mark: `{`
    first and `}` last, bar whitespace. UTF-16/32 put a NUL beside one of them, a BOM comes first."""
    return raw.lstrip(b" \t\r\n")[:1] == b"{" and raw.rstrip(b" \t\r\n")[-1:] == b"}"


def _json_bytes(body: dict) -> bytes:
    """`body` as httpx's `json=` would send it, except that a string holding a lone
    UTF-16 surrogate (valid JSON as an escape, not encodable as UTF-8) goes out
    escaped, as the client sent it, instead of failing the request."""
    try:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode("ascii")


class _Paced:
    """An httpx response (https upstreams, injected transports) whose body keeps the limits the
    lean client (proxy/upstream_http.py) keeps itself: the first body byte by the first-byte
    deadline, then no silence longer than the idle timeout. Everything else is httpx's."""

    def __init__(self, response: httpx.Response, timeouts: UpstreamTimeouts, started: float):
        self._response = response
        self._timeouts = timeouts
        self._first_byte_deadline = None if timeouts.first_byte_s is None else started + timeouts.first_byte_s

    # The members the relay and adapters read, forwarded by name (no __getattr__: a reply's
    # surface is declared, proxy/backend.py `Reply`).
    @property
    def status_code(self) -> int:
        return self._response.status_code

    @property
    def headers(self) -> httpx.Headers:
        return self._response.headers

    async def aclose(self) -> None:
        await self._response.aclose()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        chunks = self._response.aiter_bytes().__aiter__()
        loop = asyncio.get_running_loop()
        started = False
        while True:
            if started:
                limit, why = self._timeouts.idle_s, f"the upstream sent nothing for {self._timeouts.idle_s:g} s " \
                                                    "(idle timeout)"
            else:
                limit = None if self._first_byte_deadline is None else \
                    max(0.0, self._first_byte_deadline - loop.time())
                why = f"no reply from the upstream within {self._timeouts.first_byte_s:g} s (first-byte timeout)"
            try:
                async with asyncio.timeout(limit):
                    chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError as exc:
                raise httpx.ReadTimeout(why) from exc
            started = True
            yield chunk

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aclose(self) -> None:
        await self._response.aclose()


def _larger(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(a, b)


def _excerpt(data: bytes | str, limit: int = 200) -> str:
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    return repr(text[:limit]) + (f" (… {len(text) - limit} more)" if len(text) > limit else "")


def served_by(response: httpx.Response, url: str) -> str:
    """Who answered: the worker a router picked, as it names itself (X-Prefixtrace-Worker), else the
    upstream URL the request went to (one of a pool's)."""
    worker = getattr(response, "worker_header", None)
    if worker is None and not hasattr(response, "worker_header"):  # httpx's response
        worker = response.headers.get(WORKER_HEADER.decode())
    return worker[:200] if worker else url  # the upstream's words: bounded like --worker-name


class Relayed:
    """An upstream response on its way to the client: its status, type, and whether it streams."""

    def __init__(self, response: httpx.Response, url: str):
        self.response = response
        self.url = url
        self.status = response.status_code
        # The proxy's own client read it off the raw head (proxy/upstream_http.py); httpx's has headers.
        content_type = getattr(response, "content_type_header", None)
        self.content_type = content_type if content_type is not None else \
            response.headers.get("content-type", "application/json")

    @property
    def streams_events(self) -> bool:
        return self.status < 400 and self.content_type.startswith("text/event-stream")

    stage = UPSTREAM_BODY  # a client that leaves now is recorded as abandoned while the body came
    on_final: Callable[[], None] | None = None  # only a chat stream tells its turn complete early

    def cancel(self) -> None:
        pass  # closing the response (in `sse`'s finally) is what tells the upstream

    async def event_batches(self) -> AsyncIterator[list[bytes]]:
        """The response's SSE events as they arrive, split on the bytes (prefixtrace/wire/sse.py),
        those that one read of the upstream completed together in one list. An event that grows
        without end is the upstream's fault (`UpstreamError`), not a buffer without bound."""
        try:
            async for batch in sse.iter_event_batches(bounded(self.response.aiter_bytes())):
                yield batch
        except (sse.EventTooLarge, ReplyTooLarge) as exc:
            raise UpstreamError(f"upstream {self.url} {exc}", upstream=self.url) from exc

    async def read(self) -> tuple[bytes, dict | None]:
        """The whole body, and its JSON object when it is one. A success (status < 400) whose body
        is not a JSON object (invalid, empty, a list) is the upstream's fault: `UpstreamError`, a
        502 naming it, not a 200 with an empty reply."""
        try:
            with map_httpx_errors(self.url):
                data = b"".join([chunk async for chunk in bounded(self.response.aiter_bytes())])
        except ReplyTooLarge as exc:
            raise UpstreamError(f"upstream {self.url} {exc}", upstream=self.url) from exc
        finally:
            await self.response.aclose()
        try:
            body = json.loads(data)
            why = None if isinstance(body, dict) else f"a JSON {type(body).__name__}, not an object"
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            body, why = None, ("an empty body" if not data.strip() else f"not JSON ({exc})")
        if why is not None and self.status < 400:
            raise UpstreamError(f"upstream {self.url} answered {self.status} with {why}: {_excerpt(data)}",
                                upstream=self.url)
        return data, body if isinstance(body, dict) else None

    @contextlib.contextmanager
    def reading(self, body: dict, member: str):
        """Read a success `body` into the turn inside this block: when it lacks the list `member`
        every reply of its API carries (`choices`, `content`, `output`), or has parts of the wrong
        shape, that is the upstream's fault: `UpstreamError` (502) naming it, not a bare 500."""
        if not isinstance(body.get(member), list):
            error = body.get("error")
            why = f"an error in a {self.status}: {_excerpt(json.dumps(error, ensure_ascii=False))}" if error else \
                f"no {member!r} list"
            raise UpstreamError(f"upstream {self.url} answered a body the proxy cannot read ({why}): "
                                f"{_excerpt(json.dumps(body, ensure_ascii=False))}", upstream=self.url)
        try:
            yield
        except UNREADABLE as exc:
            raise UpstreamError(f"upstream {self.url} answered a body the proxy cannot read ({exc}): "
                                f"{_excerpt(json.dumps(body, ensure_ascii=False))}", upstream=self.url) from exc

    def read_event(self, event: bytes, read: Callable[[dict, list[Fact]], None], told: list[Fact]) -> None:
        """One streamed event read by `read(data, told)` (its JSON data), which adds to `told` what it tells
        the turn. An event the proxy cannot read (data that is not a JSON object, or one of the wrong
        shape) is still the client's, as it came: the turn is told the upstream's fault (`fault`)."""
        data = sse.decode_data(event)
        if data is None:
            if sse.unreadable(event):
                told.append(self.fault("data that is not a JSON object", event))
            return
        try:
            read(data, told)
        except UNREADABLE as exc:
            told.append(self.fault(str(exc), event))

    @staticmethod
    def error_text(data: bytes, body: dict | None) -> str:
        """An error reply as its turn keeps it: the body's `error` (else the body), or the bytes that did
        not parse, cut at 2,000 characters."""
        return (str(body.get("error", body)) if body is not None else data.decode(errors="replace"))[:2000]

    def fault(self, why: str, event: bytes) -> UpstreamFault:
        """An unreadable event of a stream, as its turn keeps it (the first one; the client got it as sent)."""
        return UpstreamFault(f"upstream {self.url} sent an event the proxy cannot read ({why}): {_excerpt(event)}")

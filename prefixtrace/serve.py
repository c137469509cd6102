"""Build and run the proxy: backend (embedded engine or upstream) + recorder + uvicorn."""

from __future__ import annotations

import logging
import resource
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.main import STARTUP_FAILURE

from prefixtrace.common.errors import EngineError
from prefixtrace.common.urls import display_url
from prefixtrace.instance_key import remove_key, write_key
from prefixtrace.preflight import check_database_writable, claim_port, ready_banner
from proxy.app import create_app
from analyzer.fixes.sessions import FixSessions
from proxy.connections import (HEAD_TIMEOUT_S, KEEP_ALIVE_S, MAX_HEAD_KB, QueryValuesMasked,
                               open_file_limit_not_lowered, raise_open_file_limit, with_head_timeout)
from proxy.guard import LOOPBACK_HOSTS
from proxy.sampling_defaults import SamplingDefaults
from proxy.upstream_backend import UpstreamBackend
from proxy.upstream_pool import UpstreamPool
from proxy.upstream_timeouts import UpstreamTimeouts
from recorder.store import Recorder

if TYPE_CHECKING:
    from engine.engine import Engine

# Read before the engine's imports (build_backend, embedded engine only): mlx-lm's
# import lowers the open-file limit to (2048, 4096) (kept from lowering there; where
# mlx-lm was imported already, the limit from before says what to try to restore).
_NOFILE_BEFORE_MLX = resource.getrlimit(resource.RLIMIT_NOFILE)

log = logging.getLogger("prefixtrace.serve")
# SIGTERM/SIGINT: in-flight responses get this long to finish, then are cancelled
# (and recorded as such), so shutdown always completes; then the recorder gets
# RECORDER_CLOSE_S to write what is queued. A refused 30 MB body is answered before
# its commit (proxy/relay.py record_refusal) and its write took up to 9 s on a loaded
# two-core machine, so the bound leaves room for several; it only delays the exit of a
# writer that is stuck, never of one that finishes.
SHUTDOWN_GRACE_S = 30
RECORDER_CLOSE_S = 30.0


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    db: Path = Path("prefixtrace.db")
    model: Path | None = None  # None: the bundled default model
    upstreams: list[str] = field(default_factory=list)  # several: an UpstreamPool
    upstream_timeouts: UpstreamTimeouts = field(default_factory=UpstreamTimeouts)  # connect, first byte, idle
    dtype: str | None = None
    cache_memory_gb: float | None = None  # None: engine.memory.default_cache_bytes
    prefill_chunk: int | None = None  # None: engine.memory.default_prefill_chunk (per device)
    max_batch: int = 8
    memory_ceiling_gb: float | None = None
    cache_dir: Path | None = None  # disk tier of the prefix cache; None: memory only
    cache_disk_gb: float = 16.0
    block_size: int | None = None  # None: engine.prefix_cache.DEFAULT_BLOCK_SIZE
    kv_quant: str = "none"  # or "turboquant" (docs/TURBOQUANT.md)
    kv_bits: int = 4
    kv_dense_layers: tuple[int, ...] = (-1,)  # layers kept dense under turboquant
    mid_system_policy: str = "inline"  # fold|inline|strict (docs/RENDER_POLICIES.md)
    thinking_retention: str = "loop"  # loop|template|all
    thinking_retention_guard_tokens: int = 30000
    notice_pattern: str | None = None  # None: engine.render_policy.DEFAULT_NOTICE_PATTERN
    max_tokens_policy: str = "clamp"  # clamp|reject: a max_tokens beyond what fits after the prompt
    max_request_mb: float = 32.0  # proxy/request_limits.py: 413 past it
    request_body_timeout_s: float = 60.0  # proxy/request_limits.py: 408 past it
    max_header_kb: int = 64  # proxy/connections.py: 431 past it
    recorder_stuck_after_s: float = 30.0  # /health is 503 once one recorder write takes longer
    default_temperature: float | None = None  # None: each protocol's own default (proxy/sampling_defaults.py)
    default_frequency_penalty: float | None = None  # free replies' penalty when unset; None: 0 (proxy/sampling_defaults.py)
    tool_choice_default: str = "auto"  # or "required-after-user" / "required-until-tool-result": a test aid for small models (docs/TOOLS.md)
    default_max_tokens: int | None = None  # output cap of requests that set none (proxy/sampling_defaults.py)
    grammar_max_string: int = 4096  # maxLength of a forced reply's strings that set none (engine/grammar.py)
    log_level: str = "info"
    allow_client_templates: bool = False  # chat_template_kwargs.chat_template, sandboxed (docs/SECURITY.md)
    allowed_hosts: list[str] | None = None  # Host header names; None: loopback + `host` (proxy/guard.py)
    otlp_endpoint: str | None = None  # OTLP/HTTP collector: one span per turn (prefixtrace/otel.py)
    store: str = "full"  # "hashes": no text recorded (recorder/hashing.py)
    worker_name: str | None = None  # X-Prefixtrace-Worker on every response; None: host:port (docs/FLEET.md)
    fixes: list[str] = field(default_factory=list)  # --fix: the fixes applied to every request (docs/FIXES.md)


def allowed_hosts(config: ServeConfig) -> list[str]:
    """The names the Host header may carry: as configured, else loopback and the bound address."""
    if config.allowed_hosts is not None:
        return config.allowed_hosts
    bound = [] if config.host in ("", "0.0.0.0", "::") else [config.host]
    return [*LOOPBACK_HOSTS, *bound]


def build_backend(config: ServeConfig):
    """The one place the backend is chosen: the upstream(s) of `--upstream`, else the embedded engine.
    Only the engine's branch imports the engine (and so MLX): an upstream-mode proxy never loads it."""
    if len(config.upstreams) > 1:
        log.info("forwarding to %d upstreams with session affinity: %s", len(config.upstreams),
                 ", ".join(map(display_url, config.upstreams)))
        return UpstreamPool(config.upstreams, timeouts=config.upstream_timeouts,
                            probe_props=True)  # each member's published template, once
    if config.upstreams:
        log.info("forwarding to upstream %s", display_url(config.upstreams[0]))
        return UpstreamBackend(config.upstreams[0], timeouts=config.upstream_timeouts,
                               probe_props=True)  # its published chat template, once
    return _engine_backend(config)


def _engine_backend(config: ServeConfig):
    with open_file_limit_not_lowered():  # the first import of mlx-lm in this process
        from engine.default_model import DEFAULT_MODEL_NAME, default_model_dir
        from engine.engine import Engine
        from engine.grammar import DEFAULT_LIMITS
        from proxy.engine_backend import EngineBackend

    if config.model is None:
        model_dir, name = default_model_dir(), DEFAULT_MODEL_NAME
    else:
        model_dir, name = config.model, None
    engine = Engine(
        model_dir,
        name=name,
        dtype=config.dtype,
        cache_bytes=None if config.cache_memory_gb is None else int(config.cache_memory_gb * (1 << 30)),
        prefill_step_size=config.prefill_chunk,
        max_batch=config.max_batch,
        memory_ceiling_bytes=None if config.memory_ceiling_gb is None else int(config.memory_ceiling_gb * (1 << 30)),
        cache_dir=config.cache_dir,
        cache_disk_bytes=int(config.cache_disk_gb * (1 << 30)),
        kv_quant=config.kv_quant,
        kv_bits=config.kv_bits,
        kv_dense_layers=config.kv_dense_layers,
        mid_system_policy=config.mid_system_policy,
        thinking_retention=config.thinking_retention,
        thinking_retention_guard_tokens=config.thinking_retention_guard_tokens,
        notice_pattern=config.notice_pattern,
        allow_client_templates=config.allow_client_templates,
        **({} if config.block_size is None else {"block_size": config.block_size}),
    ).start()
    log.info("loading model from %s (dtype %s)", model_dir, config.dtype or "as stored")
    log.debug("render policies: %s", engine.render_policy.describe())
    if config.tool_choice_default != "auto":
        log.warning("--tool-choice-default %s: requests with tools whose last message is a user turn are forced to "
                    "call one (a test aid for small models, docs/TOOLS.md)", config.tool_choice_default)
    defaults = SamplingDefaults(temperature=config.default_temperature, max_tokens=config.default_max_tokens,
                                frequency_penalty=config.default_frequency_penalty)
    for line in defaults.describe():
        log.info("%s", line)
    backend = EngineBackend(engine, max_tokens_policy=config.max_tokens_policy,
                            tool_choice_default=config.tool_choice_default, defaults=defaults,
                            grammar_limits=replace(DEFAULT_LIMITS, string_chars=config.grammar_max_string))
    return backend


def uvicorn_config(app, host: str, port: int, log_level: str, *, head_timeout_s: float = HEAD_TIMEOUT_S,
                   max_head_kb: int = MAX_HEAD_KB) -> uvicorn.Config:
    """uvicorn as `serve` runs it: idle keep-alive and request-head timeouts, the request head's
    limit (proxy/connections.py), bounded graceful shutdown."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=with_head_timeout(head_timeout_s, max_head_kb),
                          timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=SHUTDOWN_GRACE_S)


def _stop_if_the_model_fails_to_load(engine: Engine, server: uvicorn.Server, failures: list) -> threading.Thread:
    """The model loads in the background while the server listens; a model that
    cannot load (a directory that is not a model, a broken config.json) stops the
    server, so `serve` exits non-zero naming the cause instead of answering 503
    forever."""

    def watch():
        try:
            engine.wait_ready()
        except EngineError as exc:
            failures.append(exc)
            server.should_exit = True

    thread = threading.Thread(target=watch, name="prefixtrace-load-watch", daemon=True)
    thread.start()
    return thread


def _announce_when_ready(server: uvicorn.Server, engine: Engine | None, base_url: str, db: Path) -> threading.Thread:
    """Print where to point a client once the server answers and the model is loaded
    (not before: a harness started on the first line would meet 503s)."""

    def watch():
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if engine is not None:
            try:
                engine.wait_ready()
            except EngineError:
                return
        if server.started and not server.should_exit:
            for line in ready_banner(base_url, db):
                print(line, file=sys.stderr, flush=True)

    thread = threading.Thread(target=watch, name="prefixtrace-ready-banner", daemon=True)
    thread.start()
    return thread


def _base_url(listener, host: str) -> str:
    port = listener.getsockname()[1]
    shown = "127.0.0.1" if host in ("", "0.0.0.0") else ("[::1]" if host == "::" else host)
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/v1"


def serve(config: ServeConfig) -> None:
    # Claimed before the model loads: a busy port or an unwritable database is
    # refused in one line within a second, and leaves nothing behind.
    listener = claim_port(config.host, config.port)
    try:
        check_database_writable(config.db)
        _serve_on(listener, config)
    finally:
        listener.close()


def worker_name(config: ServeConfig, listener) -> str:
    """`--worker-name`, else the address it serves on (`host:port`; the machine's name when bound to all)."""
    if config.worker_name:
        return config.worker_name
    host = config.host
    if host in ("", "0.0.0.0", "::"):
        import socket

        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{listener.getsockname()[1]}"


def _keep_instance_key(app, listener, db: Path) -> tuple[Path, bytes] | None:
    """The secret `prefixtrace run` checks this proxy by (prefixtrace/common/instance_proof.py), kept in the
    user's private directory for as long as it serves; without one, `run` does not reuse it."""
    try:
        path, secret = write_key(listener.getsockname()[1], db.resolve())
    except OSError as exc:
        log.warning("no instance key (%s): `prefixtrace run` will not reuse this proxy unless given --url", exc)
        return None
    app.state.instance_secret = (secret, str(db.resolve()))
    return path, secret


class Terminated(Exception):
    """SIGTERM, as an exception in the main thread."""


@contextmanager
def _terminate_as_exception():
    """uvicorn stops gracefully on SIGTERM, then raises the signal again with the handler it found.
    The default one ended the process there, before the recorder was closed and the engine stopped
    (a spill directory left in the temp dir, the last queued turns given no time): with this handler
    the signal becomes `Terminated`, and the `finally` blocks run as they do for Ctrl-C."""
    def raise_terminated(signum, frame):
        raise Terminated()

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve_on(listener, config: ServeConfig) -> None:
    backend = build_backend(config)
    engine = None if config.upstreams else backend.engine
    try:
        recorder = Recorder(config.db, stuck_after_s=config.recorder_stuck_after_s, hasher=_hasher(config))
        feed = key = None
        try:
            log.debug("recording to %s", config.db.resolve())  # the ready line says it
            if config.otlp_endpoint:
                from prefixtrace.otel import LiveFeed, TurnSpans

                feed = LiveFeed(TurnSpans.open(config.otlp_endpoint))
                log.info("exporting one span per turn to %s (OTLP/HTTP)", display_url(feed.spans.url))
            app = create_app(backend, recorder, allowed_hosts=allowed_hosts(config), max_request_mb=config.max_request_mb,
                             turn_feed=feed, worker_name=worker_name(config, listener),
                             fixes=FixSessions(config.fixes) if config.fixes else None)
            app.state.request_body_timeout_s = config.request_body_timeout_s  # proxy/request_limits.py
            key = _keep_instance_key(app, listener, config.db)
            raise_open_file_limit(_NOFILE_BEFORE_MLX)
            server = uvicorn.Server(uvicorn_config(app, config.host, listener.getsockname()[1], config.log_level,
                                                   max_head_kb=config.max_header_kb))
            logging.getLogger("uvicorn.access").addFilter(QueryValuesMasked())
            if config.log_level == "info":  # uvicorn's start and stop lines say nothing a user acts on
                logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
            failures: list[EngineError] = []
            if engine is not None:
                _stop_if_the_model_fails_to_load(engine, server, failures)
            _announce_when_ready(server, engine, _base_url(listener, config.host), config.db.resolve())
            try:
                with _terminate_as_exception():
                    server.run(sockets=[listener])
            except (KeyboardInterrupt, Terminated):
                pass
            if failures:
                raise failures[0]
            if not server.started:
                sys.exit(STARTUP_FAILURE)
        finally:
            if key is not None:
                remove_key(*key)
            recorder.close(timeout=RECORDER_CLOSE_S)  # bounded: a stuck writer must not keep the process up
            if feed is not None:
                feed.close(RECORDER_CLOSE_S)  # the last turns' spans, bounded as the recorder is
    finally:
        if engine is not None:
            engine.shutdown()


def _hasher(config: ServeConfig):
    """`--store hashes`: the recorder's hasher, counting tokens as the analysis does by default."""
    if config.store != "hashes":
        return None
    from analyzer.tokens import as_tokenizer
    from recorder.hashing import Hasher, load_key

    tokenizer = as_tokenizer(None)
    return Hasher(load_key(config.db), lambda text: len(tokenizer(text)))

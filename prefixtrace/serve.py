"""Build and run the proxy: backend (embedded engine or upstream) + recorder + uvicorn."""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from uvicorn.main import STARTUP_FAILURE

from engine.engine import Engine
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from proxy.upstream_backend import UpstreamBackend
from proxy.upstream_pool import UpstreamPool
from prefixtrace.errors import EngineError
from recorder.store import Recorder

log = logging.getLogger("prefixtrace.serve")


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    db: Path = Path("prefixtrace.db")
    model: Path | None = None  # None: the bundled default model
    upstreams: list[str] = field(default_factory=list)  # several: an UpstreamPool
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
    log_level: str = "info"


def build_backend(config: ServeConfig):
    if len(config.upstreams) > 1:
        log.info("forwarding to %d upstreams with session affinity: %s", len(config.upstreams), ", ".join(config.upstreams))
        return UpstreamPool(config.upstreams)
    if config.upstreams:
        log.info("forwarding to upstream %s", config.upstreams[0])
        return UpstreamBackend(config.upstreams[0])
    if config.model is None:
        from engine.default_model import DEFAULT_MODEL_NAME, default_model_dir

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
        **({} if config.block_size is None else {"block_size": config.block_size}),
    ).start()
    log.info("loading model from %s (dtype %s)", model_dir, config.dtype or "as stored")
    log.info("render policies: %s", engine.render_policy.describe())
    return EngineBackend(engine)


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


def serve(config: ServeConfig) -> None:
    backend = build_backend(config)
    engine = backend.engine if isinstance(backend, EngineBackend) else None
    try:
        with Recorder(config.db) as recorder:
            log.info("recording to %s", config.db.resolve())
            app = create_app(backend, recorder)
            server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level))
            failures: list[EngineError] = []
            if engine is not None:
                _stop_if_the_model_fails_to_load(engine, server, failures)
            try:
                server.run()
            except KeyboardInterrupt:
                pass
            if failures:
                raise failures[0]
            if not server.started:  # e.g. the port is in use; uvicorn has logged why
                sys.exit(STARTUP_FAILURE)
    finally:
        if engine is not None:
            engine.shutdown()

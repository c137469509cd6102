"""The embedded engine: one thread owns MLX and serves sequences from a queue.

v0 runs one sequence at a time on mlx-lm's `generate_step` (chunked prefill,
pipelined decode) over a KV cache restored from the prefix cache. The scheduler
issue replaces the inner loop with continuous batching; the thread/queue
boundary, the `Sequence` contract and the events stay.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import trim_prompt_cache

from engine.chat_render import RenderedPrompt, normalize_messages, render_prompt
from engine.model_files import load_model
from engine.prefix_cache import PrefixCache
from engine.sequence import Failed, Finished, Sequence, TextDelta
from engine.stop_strings import StopMatcher
from prefixtrace.errors import ContextExceedsCapacity, EngineError, EngineNotReady, PrefixtraceError

log = logging.getLogger("prefixtrace.engine")


class _Cancelled(Exception):
    """Raised inside mlx-lm's prefill callback to stop a cancelled prefill between chunks."""


class Engine:
    """Owns the model, the prefix cache and the thread that runs them.

    Args:
        model_dir: an mlx-lm model directory.
        name: the model name served over the API (defaults to the directory name).
        dtype: activation dtype ("float32", "float16", "bfloat16"); None keeps the files' dtype.
        cache_bytes: byte budget of the in-memory prefix cache.
        default_max_tokens: completion cap when a request sets no max_tokens.
        prefill_step_size: tokens per prefill chunk (bounds the transient memory peak).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        name: str | None = None,
        dtype: str | None = None,
        cache_bytes: int = 2 << 30,
        default_max_tokens: int = 4096,
        prefill_step_size: int = 512,
    ):
        self.model_dir = Path(model_dir)
        self.name = name or self.model_dir.name
        self.dtype = dtype
        self.cache_bytes = cache_bytes
        self.default_max_tokens = default_max_tokens
        self.prefill_step_size = prefill_step_size
        self.model = None
        self.tokenizer = None
        self.context_length: int = 0
        self.prefix_cache: PrefixCache | None = None
        self._queue: queue.Queue[Sequence | None] = queue.Queue()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="prefixtrace-engine", daemon=True)
        # Written by the engine thread only; read anywhere (ints are atomic to read).
        self.stats = {"requests": 0, "cancelled": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0}

    # --- lifecycle (any thread) -------------------------------------------------

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded; re-raise a load failure."""
        self._ready.wait(timeout)
        if self._load_error is not None:
            raise EngineError(f"could not load model {self.model_dir}: {self._load_error}") from self._load_error
        return self._ready.is_set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._load_error is None

    def shutdown(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    # --- requests (any thread) --------------------------------------------------

    def render(self, messages, *, tools=None, chat_template_kwargs=None) -> RenderedPrompt:
        """Render a chat request with the model's template. Thread-safe; no MLX work."""
        if not self.ready:
            raise EngineNotReady("the model is still loading")
        return render_prompt(
            self.tokenizer, normalize_messages(messages), tools=tools, chat_template_kwargs=chat_template_kwargs
        )

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        need = num_prompt_tokens + (max_tokens or 1)
        if need > self.context_length:
            raise ContextExceedsCapacity(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens or 1}) exceeds the model's "
                f"context of {self.context_length} tokens",
                prompt_tokens=num_prompt_tokens,
                max_tokens=max_tokens,
                max_context_tokens=self.context_length,
                retryable=False,
            )

    def submit(self, seq: Sequence) -> None:
        if not self.ready:
            raise EngineNotReady("the model is still loading")
        self._queue.put(seq)

    # --- the engine thread ------------------------------------------------------

    def _main(self) -> None:
        try:
            self.model, self.tokenizer, config = load_model(self.model_dir, self.dtype)
            self.context_length = int(config.get("max_position_embeddings") or 4096)
            self.prefix_cache = PrefixCache(self.model, max_bytes=self.cache_bytes)
            log.info("model %s loaded from %s (context %d tokens)", self.name, self.model_dir, self.context_length)
        except BaseException as exc:  # reported through wait_ready()
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        while (seq := self._queue.get()) is not None:
            try:
                self._run(seq)
            except PrefixtraceError as exc:
                seq.emit(Failed(exc))
            except Exception as exc:
                log.exception("engine failed on sequence %d", seq.seq_id)
                seq.emit(Failed(EngineError(f"engine failure: {exc!r}")))

    def _run(self, seq: Sequence) -> None:
        if seq.cancelled:
            seq.emit(Finished("cancelled", seq.num_prompt_tokens, 0, 0, 0.0, 0.0))
            return
        start = time.perf_counter()
        hit = self.prefix_cache.lookup(seq.prompt_ids)
        seq.num_cached_tokens = hit.num_cached
        cache = hit.cache
        params = seq.params
        max_tokens = params.max_tokens or min(self.default_max_tokens, self.context_length - seq.num_prompt_tokens)
        if params.seed is not None:
            mx.random.seed(params.seed)
        detok = self.tokenizer.detokenizer
        detok.reset()
        stops = StopMatcher(params.stop)
        eos = set(self.tokenizer.eos_token_ids)
        finish = "length"
        first_token_at = None

        def on_progress(done: int, total: int) -> None:
            if seq.cancelled and done < total:
                raise _Cancelled

        tokens = generate_step(
            mx.array(seq.prompt_ids[hit.num_cached :]),
            self.model,
            prompt_cache=cache,
            sampler=params.make_sampler(),
            max_tokens=max_tokens,
            prefill_step_size=self.prefill_step_size,
            prompt_progress_callback=on_progress,
        )
        try:
            for token, _ in tokens:
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                seq.output_ids.append(token)
                if token in eos:
                    finish = "stop"
                    break
                detok.add_token(token)
                text, hit_stop = stops.feed(detok.last_segment)
                if text:
                    seq.emit(TextDelta(text, [token]))
                if hit_stop:
                    finish = "stop"
                    break
                if seq.cancelled:
                    finish = "cancelled"
                    break
            else:
                detok.finalize()
                text, _ = stops.feed(detok.last_segment)
                text += stops.flush()
                if text:
                    seq.emit(TextDelta(text, []))
        except _Cancelled:
            finish = "cancelled"
        finally:
            tokens.close()
            self._keep(seq, cache)
        end = time.perf_counter()
        first = first_token_at or end
        self._count(seq, finish)
        seq.emit(
            Finished(
                finish,
                seq.num_prompt_tokens,
                seq.num_completion_tokens,
                seq.num_cached_tokens,
                prefill_s=first - start,
                decode_s=end - first,
            )
        )

    def _count(self, seq: Sequence, finish: str) -> None:
        self.stats["requests"] += 1
        self.stats["cancelled"] += finish == "cancelled"
        self.stats["prompt_tokens"] += seq.num_prompt_tokens
        self.stats["cached_tokens"] += seq.num_cached_tokens
        self.stats["generated_tokens"] += seq.num_completion_tokens

    def _keep(self, seq: Sequence, cache) -> None:
        """Store what was computed (also for a cancelled or failed run) for later prefixes."""
        ids = seq.all_ids
        extra = cache[0].offset - len(ids)
        if extra > 0:  # mlx-lm fed a sampled token that was never delivered
            trim_prompt_cache(cache, extra)
        self.prefix_cache.store(ids, cache)

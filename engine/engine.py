"""The embedded engine: one thread owns MLX and serves sequences from a queue.

The thread loads the model, then alternates between taking new sequences off
the queue and one `Scheduler.step()` (continuous batching over the prefix
cache). Other threads only render prompts, submit sequences and read events.
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path

import mlx.core as mx

from engine.kernels import selector
from engine.chat_render import (PromptOverLimit, RenderedPrompt, encode_within, normalize_messages, render_prompt,
                                thinking_kwargs, token_bound)
from engine.disk_cache import CacheDirUnusable
from engine.grammar import GrammarCompiler
from engine.memory import (CACHE_FRACTION, DEFAULT_CEILING_FRACTION, MemoryModel, default_cache_bytes, default_prefill_chunk,
                           machine_memory_bytes, measured, weights_bytes)
from engine.model_files import load_model_dir
from engine.reply_parser import ReplyFormat
from engine.prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_DISK_BYTES, PrefixCache
from engine.render_policy import DEFAULT_GUARD_TOKENS, BoundPolicy, NoticeRule, RenderPolicy, TemplateTraits
from engine.scheduler import Scheduler
from engine.attention_hook import install_attention_hook
from engine.tq_config import TQConfig
from engine.sequence import Failed, Sequence
from prefixtrace.common.errors import ContextExceedsCapacity, EngineError, EngineNotReady, PrefixtraceError

log = logging.getLogger("prefixtrace.engine")


class Engine:
    """Owns the model, the prefix cache and the thread that runs them.

    Args:
        model_dir: an mlx-lm model directory.
        name: the model name served over the API (defaults to the directory name).
        dtype: activation dtype ("float32", "float16", "bfloat16"); None keeps the files' dtype.
        cache_bytes: byte budget of the in-memory prefix cache (None: memory.default_cache_bytes,
            a share of the memory left after the weights).
        default_max_tokens: completion cap when a request sets no max_tokens.
        prefill_step_size: tokens per prefill chunk (bounds the transient memory peak; None: the
            per-device default measured in docs/PERFORMANCE.md, memory.default_prefill_chunk).
        max_batch: most sequences decoding together.
        loader: optional callable returning (model, tokenizer, config), run on the engine thread.
        cache_dir: directory of the prefix cache's disk tier (None: memory only); a restarted
            engine on the same directory and model reuses the prompts cached there.
        cache_disk_bytes: byte budget of the disk tier.
        block_size: tokens per prefix-cache block (docs/CACHE.md).
        memory_ceiling_bytes: what weights + KV + prefill peak may use (default: 3/4 of the
            machine's or accelerator's memory, less the prefix cache's budget).
        kv_quant: "none" or "turboquant" (KV of every layer but `kv_dense_layers` as TurboQuant codes,
            docs/TURBOQUANT.md; the prefix cache then pages TurboQuant blocks, docs/CACHE.md).
        kv_bits: bits per coordinate with kv_quant="turboquant" (1..8).
        kv_dense_layers: layer indices (negative from the end) whose KV stays dense under
            TurboQuant; default the last layer.
        mid_system_policy: "fold", "inline" or "strict": later system/developer messages
            (docs/RENDER_POLICIES.md).
        thinking_retention: "loop", "template" or "all": which past reasoning the prompt keeps.
        thinking_retention_guard_tokens: with "loop", reasoning kept in one agent loop past this
            many tokens is cut once.
        notice_pattern: regex matched at the start of a user message's text that marks it as a
            harness notice, not a real user turn (None: render_policy.DEFAULT_NOTICE_PATTERN).
        allow_client_templates: accept a request's own chat template (chat_template_kwargs.chat_template),
            rendered in a bounded child process; refused with a 400 otherwise.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        name: str | None = None,
        dtype: str | None = None,
        cache_bytes: int | None = None,
        default_max_tokens: int = 4096,
        prefill_step_size: int | None = None,
        max_batch: int = 8,
        loader=None,
        cache_dir: str | Path | None = None,
        cache_disk_bytes: int = DEFAULT_DISK_BYTES,
        block_size: int = DEFAULT_BLOCK_SIZE,
        memory_ceiling_bytes: int | None = None,
        kv_quant: str = "none",
        kv_bits: int = 4,
        kv_dense_layers: tuple[int, ...] = (-1,),
        mid_system_policy: str = "inline",
        thinking_retention: str = "loop",
        thinking_retention_guard_tokens: int = DEFAULT_GUARD_TOKENS,
        notice_pattern: str | None = None,
        allow_client_templates: bool = False,
        cold_dense_prefill: bool = True,
    ):
        if kv_quant not in ("none", "turboquant") or not 1 <= kv_bits <= 8:
            raise EngineError(f"kv_quant must be none|turboquant and kv_bits 1..8 (got {kv_quant!r}, {kv_bits})")
        self.kv_quant, self.kv_bits = kv_quant, kv_bits
        self.tq = TQConfig(bits=kv_bits, dense_layers=tuple(kv_dense_layers)) if kv_quant == "turboquant" else None
        self.render_policy = RenderPolicy(
            mid_system_policy, thinking_retention, thinking_retention_guard_tokens,
            NoticeRule(notice_pattern) if notice_pattern is not None else NoticeRule(),
        )
        self._bound_policy: BoundPolicy | None = None  # bound to the template once the tokenizer is loaded
        self._token_bound = None  # engine/chat_render.py TokenBound, once the tokenizer is loaded
        self.allow_client_templates = allow_client_templates  # chat_template_kwargs.chat_template (docs/SECURITY.md)
        # False: a TurboQuant engine's cold prefill runs every chunk on its quantised caches (the slower
        # path, for bench_turboquant.py's side-by-side; engine/dense_prefill.py `plan`)
        self.cold_dense_prefill = cold_dense_prefill
        self.model_dir = Path(model_dir)
        # Runs on the engine thread; benchmarks pass one that builds a model in memory.
        self._loader = loader or (lambda: load_model_dir(self.model_dir, self.dtype))
        self.name = name or self.model_dir.name
        self.dtype = dtype
        self.cache_bytes = cache_bytes
        self.default_max_tokens = default_max_tokens
        self.prefill_step_size = prefill_step_size or default_prefill_chunk()
        self.max_batch = max_batch
        self.cache_dir, self.cache_disk_bytes, self.block_size = cache_dir, cache_disk_bytes, block_size
        self.memory_ceiling_bytes = memory_ceiling_bytes
        self.memory: MemoryModel | None = None
        # The longest request that fits (the memory model's, fixed once loaded; None while loading): what
        # the proxy's X-Max-Context-Tokens header and count_tokens read on every request.
        self.max_context_tokens: int | None = None
        self.model = None
        self.tokenizer = None
        self.reply_format: ReplyFormat | None = None  # how this model marks reasoning and tool calls
        self.grammar: GrammarCompiler | None = None  # constrained decoding (tool_choice, response_format)
        self.context_length: int = 0
        self.prefix_cache: PrefixCache | None = None
        self._queue: queue.Queue[Sequence | None] = queue.Queue()
        self._ready = threading.Event()
        self._stopped = threading.Event()
        self._load_error: BaseException | None = None
        self.scheduler: Scheduler | None = None
        self.tq_kernel_build_s: dict[int, float] = {}  # TurboQuant kernels built at load: {chunk: s}
        self.dense_kernel_build_s: dict[int, float] = {}  # dense decode kernels built at load (engine/kernels/prebuild.py)
        self._thread = threading.Thread(target=self._main, name="prefixtrace-engine", daemon=True)

    # --- lifecycle (any thread) -------------------------------------------------

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded; re-raise a load failure."""
        self._ready.wait(timeout)
        if isinstance(self._load_error, CacheDirUnusable):  # the model loaded; its cache directory did not
            raise self._load_error
        if self._load_error is not None:
            raise EngineError(f"could not load model {self.model_dir}: {self._load_error}") from self._load_error
        return self._ready.is_set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._load_error is None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop serving; sequences still in flight get an EngineNotReady error."""
        self._queue.put(None)
        self._stopped.wait(timeout)

    # --- requests (any thread) --------------------------------------------------

    def render(self, messages, *, tools=None, chat_template_kwargs=None, reasoning_effort: str | None = None,
               count_up_to: int | None = None) -> RenderedPrompt:
        """Render a chat request with the model's template (`reasoning_effort`: the request's switch, passed
        to the template as chat_render.thinking_kwargs says). Thread-safe; no MLX work. A prompt that cannot
        fit the context is the context error, found without tokenizing all of a huge one; `count_up_to` (a
        token count only, nothing runs) counts exactly up to that many tokens instead."""
        if not self.ready:
            raise EngineNotReady("the model is still loading")
        kwargs = thinking_kwargs(chat_template_kwargs, reasoning_effort)
        applied = self._bound_policy.apply(normalize_messages(messages), kwargs)
        try:
            rendered = render_prompt(self.tokenizer, applied.messages, tools=tools,
                                     chat_template_kwargs=applied.template_kwargs,
                                     allow_client_template=self.allow_client_templates,
                                     token_limit=count_up_to or self.memory.max_context_tokens, bound=self._token_bound)
        except PromptOverLimit as over:
            raise self._cannot_fit(over) from None
        rendered.policy = applied.record
        return rendered

    def encode_prompt(self, prompt: str) -> list[int]:
        """A raw prompt's tokens (legacy completions: the tokenizer's own BOS), or the context error
        for one that cannot fit, found without tokenizing all of a huge one. Thread-safe."""
        if not self.ready:
            raise EngineNotReady("the model is still loading")
        try:
            return encode_within(self.tokenizer, prompt, self.memory.max_context_tokens, self._token_bound)
        except PromptOverLimit as over:
            raise self._cannot_fit(over) from None

    def _count_reasoning(self, text: str) -> int:
        """Tokens of a reasoning string, for the retention guard: exact up to the guard, and past it a
        lower bound that is still past it (the guard only asks whether the reasoning kept passes it), so
        a huge reasoning string is not tokenized in full."""
        try:
            return len(encode_within(self.tokenizer, text, self.render_policy.guard_tokens + 1, self._token_bound,
                                     add_special_tokens=False))
        except PromptOverLimit as over:
            return over.at_least

    def _cannot_fit(self, over: PromptOverLimit) -> ContextExceedsCapacity:
        if over.limit > self.memory.max_context_tokens:  # a count asked for: past what is counted
            return ContextExceedsCapacity(
                f"the prompt is at least {over.at_least} tokens, more than this server counts ({over.limit}; "
                f"at most {self.memory.max_context_tokens} tokens fit the model)", prompt_tokens=over.at_least,
                prompt_tokens_at_least=over.at_least, retryable=False, **self.memory.numbers())
        how = (f"counted in part ({over.at_least} tokens past the cuts' slack)" if over.counted
               else f"{over.chars} characters, and no token of this tokenizer spans more than "
                    f"{self._token_bound.max_units} {self._token_bound.unit}")
        return ContextExceedsCapacity(
            f"the prompt (at least {over.at_least} tokens: {how}) can never fit: at most "
            f"{self.memory.max_context_tokens} tokens fit, the prompt and at least one output token",
            prompt_tokens=over.at_least, prompt_tokens_at_least=over.at_least, max_tokens=None, retryable=False,
            **self.memory.numbers())

    def renderer_identity(self) -> dict | None:
        """What renders and counts this engine's prompts, for the recorder: the model's chat template as
        the tokenizer holds it, its special tokens and its directory (with tokenizer.json). None while
        loading."""
        if not self.ready or self.tokenizer is None:
            return None
        return {"model": self.name, "model_dir": str(self.model_dir),
                "chat_template": getattr(self.tokenizer, "chat_template", None),
                "special": {k: getattr(self.tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}}

    def fit(self, num_prompt_tokens: int, max_tokens: int | None, *, clamp: bool = False) -> int | None:
        """The max_tokens a request runs with (`clamp`: lowered to what fits after the prompt), or
        ContextExceedsCapacity with the numbers for one that can never run (engine/memory.py `fit`)."""
        if not self.ready:
            raise EngineNotReady("the model is still loading")
        return self.memory.fit(num_prompt_tokens, max_tokens, clamp=clamp)

    def capacity(self) -> dict:
        """The memory model's numbers, what the scheduler holds now, and MLX's own counters."""
        if not self.ready:
            raise EngineNotReady("the model is still loading")
        return {**self.memory.numbers(), **self.scheduler.status(), "measured": measured()}

    def submit(self, seq: Sequence) -> None:
        if not self.ready:
            raise EngineNotReady("the model is still loading")
        self._queue.put(seq)

    def submit_all(self, seqs: list[Sequence]) -> None:
        """Submit several sequences so that the engine sees them in the same step (a
        wave of equal-length prompts then prefills and decodes as one batch)."""
        if not self.ready:
            raise EngineNotReady("the model is still loading")
        self._queue.put(list(seqs))

    # --- the engine thread ------------------------------------------------------

    def _main(self) -> None:
        try:
            self._serve()
        finally:
            mx.synchronize()
            self._stopped.set()
            # Park rather than return. A returning thread runs MLX's thread-local
            # destructors (its mx.compile cache), which take the GIL; when that
            # races interpreter shutdown the process aborts ("terminate called
            # without an active exception", seen under gdb). A parked daemon
            # thread is simply dropped at exit.
            threading.Event().wait()

    def _serve(self) -> None:
        try:
            self.model, self.tokenizer, config = self._loader()
            kernels = selector.select()  # the decode kernels of this process (none on the CPU)
            kernels.install_projections(self.model)  # CUDA only: batched decode reads each weight once
            if self.tq is not None or kernels.cuda:
                # attention in TurboQuant's rotated basis; on CUDA also padded dense decode (no mask)
                install_attention_hook(self.model)
            self.context_length = int(config.get("max_position_embeddings") or 4096)
            self.reply_format = ReplyFormat.for_tokenizer(self.tokenizer)
            self.grammar = GrammarCompiler(self.tokenizer, int(config.get("vocab_size") or len(self.tokenizer)))
            log.debug("reply format: tool calls %s%s, reasoning %s", self.reply_format.tool_parser_name,
                     " (Hermes assumed: the tokenizer names no tool format)" if self.reply_format.fallback else "",
                     self.reply_format.think_start or "none")
            traits = TemplateTraits.from_tokenizer(self.tokenizer)
            self._token_bound = token_bound(self.tokenizer)  # engine/chat_render.py: huge prompts refused early
            log.debug("prompt size bound: %s", f"a token spans at most {self._token_bound.max_units} "
                     f"{self._token_bound.unit}" if self._token_bound else "none (counted in chunks)")
            self._bound_policy = BoundPolicy(self.render_policy, traits, self._count_reasoning)
            log.debug("render policies: %s; template renders later system messages in place: %s, honours "
                     "preserve_thinking: %s", self.render_policy.describe(), traits.inline_system,
                     traits.preserve_thinking)
            if self.cache_bytes is None:
                self.cache_bytes = default_cache_bytes(weights_bytes(self.model))
                log.debug("prefix cache memory tier: %.1f GB (%.0f%% of the memory left after the weights)",
                         self.cache_bytes / 1e9, 100 * CACHE_FRACTION)
            self.prefix_cache = PrefixCache(
                self.model, max_bytes=self.cache_bytes, block_size=self.block_size, cache_dir=self.cache_dir,
                disk_bytes=self.cache_disk_bytes, model_dir=self.model_dir if self.cache_dir else None,
                tq=self.tq,
            )
            ceiling = self.memory_ceiling_bytes
            if ceiling is None:
                # The prefix cache's budget is memory requests cannot use.
                ceiling = int(machine_memory_bytes() * DEFAULT_CEILING_FRACTION) - self.cache_bytes
            self.memory = MemoryModel.for_model(
                self.model, context_length=self.context_length, prefill_chunk=self.prefill_step_size,
                ceiling_bytes=ceiling,
            )
            self.max_context_tokens = self.memory.max_context_tokens
            self.scheduler = Scheduler(
                self.model,
                self.tokenizer,
                self.prefix_cache,
                context_length=self.context_length,
                max_batch=self.max_batch,
                prefill_chunk=self.prefill_step_size,
                default_max_tokens=self.default_max_tokens,
                memory=self.memory,
                adapt_cache=self.tq.adapt if self.tq is not None else None,  # a TurboQuant hit passes through
                cold_dense_prefill=self.cold_dense_prefill,
            )
            if self.tq is not None:  # CUDA: every decode kernel now, not inside a request (engine/kernels/prebuild.py)
                self.tq_kernel_build_s = kernels.prebuild_tq(self.model, self.tq, self.max_batch)
            # CUDA: the padded dense decode kernel per chunk size (dense layers of TurboQuant models too)
            self.dense_kernel_build_s = kernels.prebuild_dense(self.model, self.max_batch)
            mx.synchronize()
            log.info("model %s loaded from %s (context %d tokens)", self.name, self.model_dir, self.context_length)
        except BaseException as exc:  # reported through wait_ready()
            self._load_error = exc
            self._ready.set()
            return
        self._ready.set()
        while self._take_requests(block=not self.scheduler.has_work):
            if not self.scheduler.has_work:
                continue
            try:
                self.scheduler.step()
            except Exception as exc:
                log.exception("engine step failed; failing every in-flight request")
                error = exc if isinstance(exc, PrefixtraceError) else EngineError(f"engine failure: {exc!r}")
                self.scheduler.fail_all(Failed(error))
            if not self.scheduler.has_work:
                # Idle: finish the decode step mlx-lm queued ahead, so no MLX work
                # is left pending when the process exits.
                mx.synchronize()
        self.scheduler.fail_all(Failed(EngineNotReady("the engine is shutting down")))
        self.prefix_cache.close()  # queued disk blocks land before shutdown() returns
        self.scheduler.spill.close()  # paused requests' KV went with fail_all: nothing left in the temp dir

    def _take_requests(self, block: bool) -> bool:
        """Move queued sequences into the scheduler; False once shutdown was asked."""
        try:
            item = self._queue.get(block=block)
            while True:
                if item is None:
                    return False
                for seq in item if isinstance(item, list) else [item]:
                    self.scheduler.add(seq)
                item = self._queue.get_nowait()
        except queue.Empty:
            return True

    @property
    def stats(self) -> dict:
        return self.scheduler.stats if self.scheduler else {}

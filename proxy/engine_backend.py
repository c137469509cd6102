"""The embedded engine as a backend (`proxy.backend.EmbeddedBackend`).

`EngineBackend` renders a request with the model's template, checks that it fits, plans a
constrained reply where one is asked for, and submits a `Sequence` to the engine thread. The
engine thread emits events for the sequence; `EngineChat` hops them onto the asyncio loop and
turns the output text into reply events (`prefixtrace.wire.events`: answer text, reasoning and
tool calls, separated by `engine.reply_parser` in the model family's format). Each protocol
adapter writes those events in its own shape (chat completions: proxy/chat_completions.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor

from engine.constraints import TOOL_CHOICE_DEFAULTS, ReplyPlan, plan_reply
from engine.grammar import DEFAULT_LIMITS, GrammarLimits
from engine.engine import Engine
from engine.reply_parser import ReplyParser, final_finish_reason
from engine.sequence import Failed, Finished, Outbox, Sequence, TextDelta
from proxy.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from prefixtrace.common.errors import EngineError, EngineNotReady, InvalidRequest, ModelNotFound, PrefixtraceError
from prefixtrace.wire.events import ContentDelta, ReasoningDelta, ReplyDone, ToolCallArgsDelta, ToolCallStart
from proxy.chat_request import ChatRequest
from proxy.relay import QUEUED, hang_up_error
from recorder import renderers
from recorder.turn_facts import (Constrained, ErrorText, Fact, MaxTokensClamped, RenderedBy, Rendered, ReplyTokens,
                                 Served)

DEFAULT_ALIAS = "default"
# Client templates rendering at once (each a child process, engine/template_sandbox.py): few, so their
# children cannot take the cores from everything else either.
CLIENT_TEMPLATE_RENDERS = 2


@functools.lru_cache(maxsize=1)
def _client_template_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(CLIENT_TEMPLATE_RENDERS, thread_name_prefix="prefixtrace-client-template")


MAX_TOKENS_POLICIES = ("clamp", "reject")
COUNT_FACTOR = 4  # count_tokens counts exactly up to this many contexts (a harness compacting past the limit)


class EngineBackend:
    """Args:
        engine: the embedded engine.
        tool_choice_default: "auto", "required-after-user" or "required-until-tool-result" (a test aid for small models,
            engine/constraints.py): a request with tools and no tool_choice is forced to call one
            when its last message is a user turn.
        max_tokens_policy: "clamp" (a max_tokens beyond what fits after the prompt is lowered to
            it) or "reject" (a 400 with the numbers).
        defaults: what a request that leaves temperature, output cap or frequency penalty unset
            gets (`serve --default-*`, proxy/sampling_defaults.py); applied in `start`, which
            every protocol and the legacy completions route pass through.
        grammar_limits: what a forced reply may write where its schema sets no bound (engine/grammar.py).
    """

    def __init__(self, engine: Engine, tool_choice_default: str = "auto", *, max_tokens_policy: str = "clamp",
                 defaults: SamplingDefaults = NO_DEFAULTS, grammar_limits: GrammarLimits = DEFAULT_LIMITS):
        if max_tokens_policy not in MAX_TOKENS_POLICIES:
            raise ValueError(f"max_tokens_policy must be one of {MAX_TOKENS_POLICIES}, got {max_tokens_policy!r}")
        if tool_choice_default not in TOOL_CHOICE_DEFAULTS:
            raise ValueError(f"tool_choice_default must be one of {TOOL_CHOICE_DEFAULTS}, got {tool_choice_default!r}")
        self.engine = engine
        self.tool_choice_default = tool_choice_default
        self.grammar_limits = grammar_limits
        self.max_tokens_policy = max_tokens_policy
        self.defaults = defaults
        self.renderer: renderers.RendererInfo | None = None  # the model's, read at the first turn (`_identify`)

    embedded = True  # proxy/backend.py: requests are parsed, rendered and generated here

    @property
    def label(self) -> str:
        return f"embedded:{self.engine.name}"

    def renderer_identity(self) -> dict | None:
        return self.engine.renderer_identity()

    def stats(self) -> None:
        return None  # the engine's numbers are its own gauges (proxy/metrics.py `engine_state`)

    async def aclose(self) -> None:
        pass  # the engine's thread belongs to whoever started it (prefixtrace/serve.py stops it)

    def model_ids(self) -> list[str]:
        return [self.engine.name, DEFAULT_ALIAS]

    async def ready(self) -> bool:
        return self.engine.ready

    async def capacity(self) -> dict:
        return self.engine.capacity()

    @property
    def max_context_tokens(self) -> int | None:
        return self.engine.max_context_tokens if self.engine.ready else None

    async def models(self) -> dict:
        created = int(time.time())
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": created, "owned_by": "prefixtrace"} for m in self.model_ids()],
        }

    def _check_model(self, req: ChatRequest) -> None:
        if req.model not in (None, "", *self.model_ids()):
            raise ModelNotFound(f"model {req.model!r} is not served here; available: {self.model_ids()}", param="model")
        n = req.body.get("n")
        if n is not None and n != 1:
            raise InvalidRequest(f"'n' must be 1 here (the embedded engine returns one choice), got {n!r}", param="n")

    async def open(self, req: ChatRequest, headers: dict[str, str], learnt: list[Fact], *,
                   wait_first: bool = True) -> "EngineChat":
        rendered = await self.render(req)
        # the prompt's size, and the render policies applied to it, if any (docs/RENDER_POLICIES.md)
        learnt.append(Rendered(len(rendered.text), len(rendered.token_ids), rendered.policy))
        await self._identify(learnt)
        return await self.start(req, rendered.token_ids, rendered.text, learnt, wait_first=wait_first)

    async def _identify(self, learnt: list[Fact]) -> None:
        """What the analyzer needs to count this prompt as the engine did (docs/ANALYZER.md "The
        server's renderer"): the model's renderer, once per model in the database, and the prefix cache's
        eviction count when the turn ends (`EngineChat`: a later turn's shortfall after evictions is the
        server's, not the client's)."""
        if self.renderer is None and (identity := self.engine.renderer_identity()) is not None:
            self.renderer = await asyncio.to_thread(  # reads and hashes tokenizer.json (megabytes), once per model
                renderers.from_model_dir, identity["model"], identity["model_dir"], identity["chat_template"],
                identity["special"])
        learnt += [RenderedBy(self.renderer), Served(self.label)]

    async def render(self, req: ChatRequest, *, count_only: bool = False):
        """The prompt the engine runs for `req` (chat template, tools, render policies), in a worker
        thread; also what `count_tokens` counts (`count_only`: exactly, up to `COUNT_FACTOR` x the context;
        a prompt to run is refused once it cannot fit, without tokenizing all of a huge one)."""
        self._check_model(req)
        count_up_to = COUNT_FACTOR * self.engine.max_context_tokens if count_only and self.engine.ready else None
        # A client's own template (`--allow-client-templates`) renders in a child that may take its whole
        # budget (engine/template_sandbox.py): those renders wait on threads of their own, so 16 looping
        # templates hold up each other, never the thread pool every other request renders on.
        kwargs = req.chat_template_kwargs
        client_template = kwargs is not None and "chat_template" in kwargs and self.engine.allow_client_templates
        render = functools.partial(self.engine.render, req.messages, tools=req.tools, chat_template_kwargs=kwargs,
                                   reasoning_effort=req.reasoning_effort, count_up_to=count_up_to)
        try:
            if client_template:
                rendered = await asyncio.get_running_loop().run_in_executor(_client_template_pool(), render)
            else:
                rendered = await asyncio.to_thread(render)
        except (TypeError, ValueError) as exc:  # the tokenizer refuses text it cannot encode (lone surrogates)
            if _has_lone_surrogate(req.messages) or _has_lone_surrogate(req.tools):
                raise InvalidRequest("the messages contain invalid Unicode (a lone UTF-16 surrogate)",
                                     param="messages") from exc
            raise InvalidRequest(f"the messages could not be rendered: {type(exc).__name__}: {exc}") from exc
        return rendered

    async def open_prompt(self, req: ChatRequest, prompt: str, learnt: list[Fact]) -> "EngineChat":
        """Legacy completions: `prompt` is tokenized as it is (no chat template; the tokenizer's
        own BOS, as llama.cpp and vLLM do for a raw prompt)."""
        self._check_model(req)
        if not self.engine.ready:
            raise EngineNotReady("the model is still loading")
        try:
            token_ids = await asyncio.to_thread(self.engine.encode_prompt, prompt)  # bounded: a huge prompt is refused early
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"the prompt could not be tokenized: {type(exc).__name__}: {exc}",
                                 param="prompt") from exc
        if not token_ids:
            raise InvalidRequest("the prompt is empty (no tokens)", param="prompt")
        learnt.append(Rendered(len(prompt), len(token_ids)))
        return await self.start(req, list(token_ids), prompt, learnt)

    async def start(self, req: ChatRequest, token_ids: list[int], prompt_text: str,
                    learnt: list[Fact], *, wait_first: bool = True) -> "EngineChat":
        """Submit a prompt's tokens; returns once the engine has answered (or raises its refusal).
        `wait_first=False` returns once submitted, before prefill: a failure after that reaches the
        reply's events instead of the HTTP status (the Responses stream says `response.created` first)."""
        req = dataclasses.replace(req, sampling=self.defaults.for_request(req.sampling, req.body))
        self._fit_max_tokens(req, len(token_ids), learnt)
        # Compiling a grammar (and, once per model, llguidance's view of the vocabulary) is CPU work.
        plan = await asyncio.to_thread(
            plan_reply, fmt=self.engine.reply_format, grammar=self.engine.grammar, tools=req.tools,
            tool_choice=req.tool_choice, response_format=req.response_format, messages=req.messages,
            prompt_text=prompt_text, tool_choice_default=self.tool_choice_default, limits=self.grammar_limits)
        if plan.forced:
            learnt.append(Constrained(plan.forced))
        chat = EngineChat(req, self.engine.name, plan)
        sampling = req.sampling if plan.processor is not None else self.defaults.for_free_reply(req.sampling, req.body)
        seq = Sequence(token_ids, sampling, chat.outbox.put)
        if plan.processor is not None:
            seq.logits_processors.append(plan.processor)
        chat.seq = seq
        self.engine.submit(seq)
        if wait_first:
            try:
                await chat.first_event()
            except asyncio.CancelledError:
                # The client hung up while the request was queued or prefilling: the engine drops it
                # at its next step (a prefill keeps the blocks it computed), and the turn, which
                # `serve_turn` records, says how far it got.
                chat.cancel()
                learnt.append(ErrorText(hang_up_error(chat.stage)))
                raise
        return chat


    def _fit_max_tokens(self, req, num_prompt_tokens: int, learnt: list[Fact]) -> None:
        """The engine fits the request (engine/memory.py `MemoryModel.fit`): a 400 with the numbers for one
        that can never run, or under the clamp policy a max_tokens beyond what fits after the prompt
        lowered to what fits, and the turn says so."""
        asked = req.sampling.max_tokens
        req.sampling.max_tokens = self.engine.fit(num_prompt_tokens, asked, clamp=self.max_tokens_policy == "clamp")
        if req.sampling.max_tokens != asked:
            learnt.append(MaxTokensClamped(asked, req.sampling.max_tokens))


class EngineChat:
    """One request's stream of engine events, as reply events (`prefixtrace.wire.events`): what
    every protocol adapter writes in its own shape (proxy/chat_completions.py, anthropic.py,
    responses.py, completions.py)."""

    status = 200

    def __init__(self, req: ChatRequest, model: str, plan: ReplyPlan | None = None):
        self.req = req
        self.model = req.model or model
        self.created = int(time.time())  # when the request was submitted: a chat reply's `created`
        self.seq: Sequence | None = None
        self.plan = plan
        self.parser = ReplyParser(plan.fmt, tools=req.tools, parse_tools=plan.parse_tools,
                                  reasoning=plan.reasoning_open,
                                  stream_arguments=plan.forced == "tool_call") if plan is not None else None
        self.finished: Finished | None = None  # the engine's last event, for timings
        self.outbox = Outbox()  # where the engine thread leaves this request's events (its `emit`)
        self._first = None

    async def first_event(self) -> None:
        """Wait for the first event so that a failure before any output keeps its HTTP status."""
        self._first = await self.outbox.get()
        if isinstance(self._first, Failed):
            raise self._first.error

    async def events(self):
        event = self._first if self._first is not None else await self.outbox.get()
        while True:
            yield event
            if isinstance(event, (Finished, Failed)):
                return
            event = await self.outbox.get()

    async def reply_events(self):
        """The reply as `prefixtrace.wire.events`, ending with ReplyDone, the engine's `ReplyTokens`
        (recorder/turn_facts.py) just before the reply's last events; an engine failure is raised
        (a PrefixtraceError). A writer sends the reply events and passes the `ReplyTokens` on to
        its turn."""
        async for event in self.events():
            if isinstance(event, TextDelta):
                for reply_event in self.parser.feed(event.text):
                    yield reply_event
            elif isinstance(event, Finished):
                self.finished = event
                if self.seq is not None:
                    # The reply's tokens follow the prompt in the engine's cache: the next turn's prefix
                    # reaches into them, and the analyzer predicts how far (docs/ANALYZER.md). Blocks the prefix
                    # cache evicted for room so far (on the engine's Finished event): between this turn's end and
                    # the session's next, a growth means the next turn may find its prefix gone.
                    yield ReplyTokens(list(self.seq.output_ids), event.cache_evictions)
                for reply_event in self.parser.finish():
                    yield reply_event
                yield ReplyDone(final_finish_reason(event.finish_reason, self.parser), event.prompt_tokens,
                                event.completion_tokens, event.cached_tokens)
            elif isinstance(event, Failed):
                err = event.error
                raise err if isinstance(err, PrefixtraceError) else EngineError(str(err))

    def cancel(self) -> None:
        if self.seq is not None:
            self.seq.cancel()

    @property
    def stage(self) -> str:
        """How far the engine has taken the request (`Sequence.stage`): queued, prefilling, decoding."""
        return self.seq.stage if self.seq is not None else QUEUED

    async def collect(self) -> "CollectedReply":
        """The whole reply, gathered from its events (a non-streamed request)."""
        return await collect(self.reply_events())


class CollectedReply:
    """A whole reply gathered from its events: text, reasoning, OpenAI-shaped tool calls, the end, the
    events themselves (what a writer records its turn from) and the engine's facts for the turn
    (`ReplyTokens`), which the writer passes on with its body."""

    def __init__(self):
        self.events: list = []
        self.facts: list[Fact] = []
        self.text = ""
        self.reasoning = ""
        self.tool_calls: list[dict] = []
        self.done: ReplyDone | None = None

    def add(self, event) -> None:
        if isinstance(event, ReplyTokens):
            self.facts.append(event)
            return
        self.events.append(event)
        if isinstance(event, ContentDelta):
            self.text += event.text
        elif isinstance(event, ReasoningDelta):
            self.reasoning += event.text
        elif isinstance(event, ToolCallStart):
            self.tool_calls.append({"id": event.call_id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}})
        elif isinstance(event, ToolCallArgsDelta):
            self.tool_calls[event.index]["function"]["arguments"] += event.text
        elif isinstance(event, ReplyDone):
            self.done = event


async def collect(events) -> CollectedReply:
    reply = CollectedReply()
    async for event in events:
        reply.add(event)
    if reply.done is None:
        raise RuntimeError("engine stream ended without a result")
    return reply


def _has_lone_surrogate(value) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False

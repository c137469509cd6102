"""What a request that leaves a sampling setting unset gets: `serve --default-temperature T`,
`--default-max-tokens N`, `--default-frequency-penalty P`.

OpenAI's default temperature is 1.0, and most coding agents send no temperature at all, so their
runs against a small local model are random draws. llama.cpp (`--temp`) and vLLM
(`--generation-config`) let the server choose instead; so does this. The harness conformance suite
(tests/harness/, docs/HARNESSES.md) serves with `--default-temperature 0`, so the tool call a
harness gets is the model's greedy choice and the run is reproducible.

Codex sends no output cap at all (its `model_max_output_tokens` is not sent by 0.171.0), so a small
model's free answer runs until it stops or the context ends: minutes on a CPU. `--default-max-tokens N`
(llama.cpp's `--n-predict`) caps such a request at N output tokens (it ends with `length`).

`--default-frequency-penalty` (a test aid) makes a small model's greedy answer end instead of
repeating itself to max_tokens. It is not applied to a grammar-forced reply: there a penalty pushes
the model off every token it has written, into a string that never closes (seen with llm's forced
call on SmolLM2), and the grammar bounds the reply anyway.

A request that sets a value keeps it; the recorded body is what the client sent. The engine backend
applies these in one place (`EngineBackend.start`), which every protocol and the legacy completions
route pass through.
"""

from __future__ import annotations

import dataclasses

from prefixtrace.wire.sampling import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingDefaults:
    temperature: float | None = None  # None: the protocol's own default (OpenAI's 1.0)
    max_tokens: int | None = None  # None: the engine's cap (what fits)
    frequency_penalty: float | None = None  # None: 0; free (unforced) replies only

    def for_request(self, sampling: SamplingParams, body: dict) -> SamplingParams:
        """`sampling` with the temperature and output cap the request's `body` leaves unset
        (applied before the output cap is fitted to the context)."""
        changes = {}
        if self.temperature is not None and body.get("temperature") is None:
            changes["temperature"] = self.temperature
        if self.max_tokens is not None and sampling.max_tokens is None:
            changes["max_tokens"] = self.max_tokens
        return dataclasses.replace(sampling, **changes) if changes else sampling

    def for_free_reply(self, sampling: SamplingParams, body: dict) -> SamplingParams:
        """`sampling` with the frequency penalty, for a reply no grammar forces."""
        if self.frequency_penalty is None or body.get("frequency_penalty") is not None:
            return sampling
        return dataclasses.replace(sampling, frequency_penalty=self.frequency_penalty)

    def describe(self) -> list[str]:
        """One log line per default that is set."""
        lines = []
        if self.temperature is not None:
            lines.append(f"requests that set no temperature sample at {self.temperature:g}")
        if self.max_tokens is not None:
            lines.append(f"requests that set no output cap stop after {self.max_tokens} tokens")
        if self.frequency_penalty is not None:
            lines.append(f"free replies of requests that set no frequency_penalty get {self.frequency_penalty:g}")
        return lines


NO_DEFAULTS = SamplingDefaults()  # every setting as the request (or its protocol) leaves it

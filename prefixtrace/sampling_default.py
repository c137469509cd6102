"""`serve --default-temperature T` / `--default-max-tokens N`: what a request that sets neither gets.

OpenAI's default is 1.0, and most coding agents send no temperature at all, so their runs against a
small local model are random draws. llama.cpp (`--temp`) and vLLM (`--generation-config`) let the server
choose instead; so does this. The harness conformance suite (tests/harness/, docs/HARNESSES.md) serves
with `--default-temperature 0`, so the tool call a harness gets is the model's greedy choice and the
run is reproducible. A request that sets `temperature` keeps it; the recorded body is what the client
sent. Wrapped around the backend's `open`, so every protocol (each builds a ChatRequest) gets it.

Codex sends no output cap at all (its `model_max_output_tokens` is not sent by 0.171.0), so a small
model's free answer runs until it stops or the context ends: minutes on a CPU. `--default-max-tokens N`
(llama.cpp's `--n-predict`) caps such a request at N output tokens (it ends with `length`); a request
that sets its own cap keeps it.
"""

from __future__ import annotations

import dataclasses


def with_default_temperature(backend, temperature: float):
    """`backend` (an EngineBackend) whose requests without a temperature sample at `temperature`."""
    open_reply = backend.open

    async def open_with_default(req, builder, headers, **kwargs):
        if req.body.get("temperature") is None:
            req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, temperature=temperature))
        return await open_reply(req, builder, headers, **kwargs)

    backend.open = open_with_default
    return backend


def with_default_max_tokens(backend, max_tokens: int):
    """`backend` (an EngineBackend) whose requests without an output cap stop after `max_tokens`."""
    open_reply = backend.open

    async def open_with_default(req, builder, headers, **kwargs):
        if req.sampling.max_tokens is None:
            req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, max_tokens=max_tokens))
        return await open_reply(req, builder, headers, **kwargs)

    backend.open = open_with_default
    return backend


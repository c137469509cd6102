"""`serve --default-temperature T`: the temperature of a request that does not set one.

OpenAI's default is 1.0, and most coding agents send no temperature at all, so their runs against a
small local model are random draws. llama.cpp (`--temp`) and vLLM (`--generation-config`) let the server
choose instead; so does this. The harness conformance suite (tests/harness/, docs/HARNESSES.md) serves
with `--default-temperature 0`, so the tool call a harness gets is the model's greedy choice and the
run is reproducible. A request that sets `temperature` keeps it; the recorded body is what the client
sent. Wrapped around the backend's `open`, so every protocol (each builds a ChatRequest) gets it.
"""

from __future__ import annotations

import dataclasses


def with_default_temperature(backend, temperature: float):
    """`backend` (an EngineBackend) whose requests without a temperature sample at `temperature`."""
    open_reply = backend.open

    async def open_with_default(req, builder, headers):
        if req.body.get("temperature") is None:
            req = dataclasses.replace(req, sampling=dataclasses.replace(req.sampling, temperature=temperature))
        return await open_reply(req, builder, headers)

    backend.open = open_with_default
    return backend


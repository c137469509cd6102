"""Does a sampling penalty end a small model's greedy repetition? (issue 15, session 5)

The recorded request (fixtures/traffic/claude_code_read_answer_smol.json) is Claude Code's second
turn: its Read tool returned the scratch file, and the model answers freely. On greedy SmolLM2-135M
that answer echoes the file line after line until max_tokens (200). Claude Code then sends "Output
token limit hit. Resume directly", and the loop never ends. Here the same prompt runs through the
embedded engine, greedy, once per penalty setting, and the script prints how many tokens each
answer took before the model ended it itself.

    python bench/probe_penalties.py

Measured (session 5, tokens incl. the end token): greedy 200 (cut at max_tokens), frequency 0.5 → 30,
presence 0.5 → 30, repetition 1.1 → 45, repetition 1.2 → 31. The harness suite serves with `--default-frequency-penalty 0.5`.
"""

from __future__ import annotations

import json
import queue
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = [{}, {"frequency_penalty": 0.5}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.1},
            {"repetition_penalty": 1.2}]


def main() -> None:
    from engine.cpu_runtime import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    from engine.default_model import default_model_dir
    from engine.engine import Engine
    from engine.sampling import SamplingParams
    from engine.sequence import Failed, Finished, Sequence, TextDelta
    from prefixtrace.wire.messages import to_chat_body

    body = json.loads((ROOT / "fixtures/traffic/claude_code_read_answer_smol.json").read_text())
    chat = to_chat_body(body)  # what proxy/anthropic.py hands the engine
    engine = Engine(default_model_dir()).start()
    engine.wait_ready(300)
    try:
        prompt = engine.render(chat["messages"], tools=chat.get("tools")).token_ids
        print(f"prompt: {len(prompt)} tokens; max_tokens {body['max_tokens']}")
        for setting in SETTINGS:
            events: queue.Queue = queue.Queue()
            seq = Sequence(list(prompt), SamplingParams(temperature=0, max_tokens=body["max_tokens"], **setting),
                           events.put)
            engine.submit(seq)
            text = []
            while True:
                event = events.get(timeout=600)
                if isinstance(event, TextDelta):
                    text.append(event.text)
                elif isinstance(event, Failed):
                    raise event.error
                elif isinstance(event, Finished):
                    break
            name = ", ".join(f"{k} {v}" for k, v in setting.items()) or "greedy, no penalty"
            print(f"{name:26s} {len(seq.output_ids):4d} tokens, finish {event.finish_reason}: "
                  f"{''.join(text)[:90]!r}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()

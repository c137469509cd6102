"""A large pi-shaped recording for the analyzer's real-input speed check (issue 16; not a test):

    python bench/make_pi_shaped.py OUT.jsonl [BYTES]     (default 384 MiB)
    taskset -c 0,1 prefixtrace analyze OUT.jsonl --template ../shared/templates/qwen3.jinja --format json

Built from pi's own system prompt and tools in ../shared/traffic/pi_smol.jsonl, in the shapes the real
pi recording has and that cost the analyzer its front door: two interleaved sessions without ids,
ISO-8601 `ts` strings, assistant tool calls with `content: null`, text parts, a user message every 13
turns, one compaction per session (history replaced by a summary at its 150th turn).
"""

from __future__ import annotations

import json
import random
import sys
from datetime import datetime, timezone
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / ".." / "shared" / "traffic" / "pi_smol.jsonl"
WORDS = ("the of and to in is for that with on as file read bash edit write function class return import def "
         "value").split()
T0 = 1765233669.389


def main() -> None:
    out_path = Path(sys.argv[1])
    target = int(sys.argv[2]) if len(sys.argv) > 2 else 384 << 20
    base = json.loads(SOURCE.read_text().splitlines()[0])["request"]
    system, tools = base["messages"][0], base["tools"]
    rng = random.Random(7)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    sessions = [{"messages": [system, {"role": "user", "content": [{"type": "text", "text": f"Task {s}: " + text(40)}]}],
                 "turns": 0} for s in range(2)]
    written = i = 0
    with open(out_path, "w", encoding="utf-8") as fh:
        while written < target:
            session = sessions[i % 2]
            i += 1
            session["turns"] += 1
            n, messages = session["turns"], session["messages"]
            body = {"model": "qwen3", "messages": list(messages), "stream": True,
                    "stream_options": {"include_usage": True}, "store": False, "max_tokens": 8192, "tools": tools}
            ts = datetime.fromtimestamp(T0 + i * 7.3, timezone.utc).isoformat(timespec="milliseconds")
            record = {"id": f"r{i}", "session": None, "ts": ts.replace("+00:00", "Z"), "endpoint": "/v1/chat/completions",
                      "request": body, "response": {"status": 200},
                      "usage": {"prompt_tokens": 1000, "prompt_tokens_details": {"cached_tokens": 900}}}
            line = json.dumps(record, ensure_ascii=False) + "\n"
            fh.write(line)
            written += len(line)
            if n % 13 == 0:  # the model answers, the user asks again
                messages.append({"role": "assistant", "content": f"<think>\n{text(60)}\n</think>\n\n{text(30)}"})
                messages.append({"role": "user", "content": [{"type": "text", "text": text(20)}]})
            else:  # a tool call (OpenAI shape: content null) and its result
                call = f"call_{i}"
                messages.append({"role": "assistant", "content": None, "tool_calls": [{
                    "id": call, "type": "function",
                    "function": {"name": "read", "arguments": json.dumps({"path": f"src/f{n}.py"})}}]})
                messages.append({"role": "tool", "tool_call_id": call, "content": text(rng.randint(600, 2000))})
            if n == 150:  # compaction
                session["messages"] = [system, {"role": "user", "content": "Summary of the work so far: " + text(300)}]
    print(json.dumps({"bytes": written, "requests": i}))


if __name__ == "__main__":
    main()

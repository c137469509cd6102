"""What a model does when `--tool-choice-default required-after-user` forces it to call a tool
(docs/TOOLS.md): coding-agent prompts with Read/Bash/Write tools, through a real server and the openai
client, greedy and sampled; then one turn after a tool result (answered freely).

    python bench/probe_forced_tools.py [--model DIR]      # default: the bundled SmolLM2-135M
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOOLS = [
    {"type": "function", "function": {"name": "Read", "description": "Read a file from the local filesystem.",
                                      "parameters": {"type": "object", "properties": {"file_path": {
                                          "type": "string", "description": "The path of the file to read"}},
                                          "required": ["file_path"]}}},
    {"type": "function", "function": {"name": "Bash", "description": "Run a shell command.",
                                      "parameters": {"type": "object", "properties": {"command": {
                                          "type": "string", "description": "The command to run"}},
                                          "required": ["command"]}}},
    {"type": "function", "function": {"name": "Write", "description": "Write a file.",
                                      "parameters": {"type": "object", "properties": {
                                          "file_path": {"type": "string"}, "content": {"type": "string"}},
                                          "required": ["file_path", "content"]}}},
]
PROMPTS = ["Read the file hello.txt", "List the files in the current directory.", "Run the command `ls -la`.",
           "Create a file notes.txt containing hi", "What is in hello.txt?"]
SYSTEM = {"role": "system", "content": "You are a coding agent. Use the tools."}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    args = ap.parse_args()
    if sys.platform == "linux":
        from engine.cpu_runtime import maybe_reexec_with_openblas

        maybe_reexec_with_openblas()
    from openai import OpenAI

    from engine.cpu_runtime import default_dtype
    from engine.engine import Engine
    from proxy.app import create_app
    from proxy.engine_backend import EngineBackend
    from recorder.store import Recorder
    from testsupport.servers import running_server

    if args.model is None:
        from engine.default_model import default_model_dir
        args.model = default_model_dir()
    engine = Engine(args.model, name="probe", dtype=default_dtype()).start()
    engine.wait_ready(600)
    print(f"model {args.model.name}: tool format {engine.reply_format.tool_parser_name}"
          f"{' (Hermes fallback)' if engine.reply_format.fallback else ''}")
    backend = EngineBackend(engine, tool_choice_default="required-after-user")
    with Recorder(Path(tempfile.mkdtemp()) / "probe.db") as rec, running_server(create_app(backend, rec)) as url:
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        for prompt in PROMPTS:
            for temperature in (0.0, 0.7):
                t0 = time.perf_counter()
                reply = client.chat.completions.create(
                    model="default", messages=[SYSTEM, {"role": "user", "content": prompt}], tools=TOOLS,
                    max_tokens=80, temperature=temperature, seed=1)
                calls = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or []]
                print(f"{prompt!r:45} T={temperature}: {reply.choices[0].finish_reason:10} {calls} "
                      f"({time.perf_counter() - t0:.1f} s)")
        messages = [{"role": "user", "content": "Read the file hello.txt"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                        "name": "Read", "arguments": '{"file_path": "hello.txt"}'}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "Hello, world!"}]
        reply = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, max_tokens=40,
                                               temperature=0)
        print(f"after a tool result: {reply.choices[0].finish_reason} calls={reply.choices[0].message.tool_calls} "
              f"content={reply.choices[0].message.content!r}")
    engine.shutdown()


if __name__ == "__main__":
    main()

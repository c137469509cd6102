"""Simon Willison's `llm` (PyPI) with a Python function tool, over chat completions."""

from __future__ import annotations

import subprocess

from harness import harness_support as hs

# The tool llm runs in its own process when the model calls it: real file I/O in the scratch dir.
# **extra: the forced call's grammar follows the schema, which does not forbid more properties, and
# the model sometimes adds one ("type": "file"); a strict signature would turn that into an error result.
READ_FILE = '''
def read_file(path: str, **extra) -> str:
    "Read a text file and return its contents."
    return open(path).read()
'''


def test_llm_calls_a_python_function_through_the_proxy(llm_exe, backend, scratch, drive, tmp_path):
    user_dir = scratch.home / "llm"
    user_dir.mkdir()
    (user_dir / "extra-openai-models.yaml").write_text(
        f"- model_id: pt\n  model_name: default\n  api_base: {backend.url}/v1\n  api_key_name: pt\n"
        "  supports_tools: true\n")
    env = hs.harness_env(scratch, {"LLM_USER_PATH": str(user_dir)})
    subprocess.run([str(llm_exe), "keys", "set", "pt", "--value", "unused"], env=env, check=True, timeout=120)
    cmd = [llm_exe, "-m", "pt", "-o", "max_tokens", "200", "--functions", READ_FILE,
           f"Read the file {scratch.hello}"]
    result, records = drive("llm", cmd, env, timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    assert all(r["response"]["status"] == 200 for r in records), hs.describe(records)
    hs.assert_tool_round_trip(records, scratch, {"read_file"})
    hs.assert_recorded_calls_match_what_client_saw(records)
    check = hs.run_check(records, tmp_path / "llm.jsonl")
    assert check.returncode == 0, check.stdout + check.stderr

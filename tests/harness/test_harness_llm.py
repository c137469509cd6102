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
    # the model `prefixtrace` and its key in an LLM_USER_PATH of the product's (prefixtrace/harnesses.py)
    args, env = hs.point("llm", scratch, backend.url, hs.harness_env(scratch, {}))
    assert args == [] and "LLM_USER_PATH" in env
    models = subprocess.run([str(llm_exe), "models", "list"], env=env, check=True, capture_output=True, text=True,
                            timeout=120).stdout
    assert "prefixtrace" in models, models
    cmd = [llm_exe, "-m", "prefixtrace", "-o", "max_tokens", "200", "--functions", READ_FILE,
           f"Read the file {scratch.hello}"]
    result, records = drive("llm", cmd, env, timeout=900)
    assert result.returncode == 0, result.output[-3000:]
    assert all(r["response"]["status"] == 200 for r in records), hs.describe(records)
    hs.assert_tool_round_trip(records, scratch, {"read_file"})
    hs.assert_recorded_calls_match_what_client_saw(records)
    check = hs.run_check(records, tmp_path / "llm.jsonl")
    assert check.returncode == 0, check.stdout + check.stderr

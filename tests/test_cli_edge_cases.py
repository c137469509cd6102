"""CLI and config edge cases a demanding user hits: bad files, bad numbers, bad URLs, bad config values.

Each must end in a one-line error and a non-zero exit, never a traceback, a hang or a silently
accepted value.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from prefixtrace.cli import cli
from prefixtrace.cli_common import library_errors
from tests.conftest import ROOT, TINY_MODEL

FIXTURE = ROOT / "fixtures" / "sessions" / "todo_stale.jsonl"


pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py


def invoke(*args):
    params = inspect.signature(CliRunner).parameters
    # stdout alone in result.stdout, whatever click's version (8.1 mixes stderr in unless told not to).
    result = CliRunner(**({"mix_stderr": False} if "mix_stderr" in params else {})).invoke(cli, list(args))
    return result, result.output + (result.stderr if "mix_stderr" in params else "")


def assert_clean_error(args, code, *words):
    result, text = invoke(*args)
    assert result.exit_code == code, text
    assert "Traceback" not in text and not isinstance(result.exception, (ValueError, OSError, OverflowError)), text
    for word in words:
        assert word in text, text
    return text


# --- serve: numbers and URLs are checked before anything starts -----------------------------

@pytest.mark.parametrize("args, word", [
    (["--port", "70000"], "--port"),
    (["--port", "-1"], "--port"),
    (["--cache-memory-gb", "-1"], "--cache-memory-gb"),
    (["--cache-memory-gb", "nan"], "--cache-memory-gb"),
    (["--cache-disk-gb", "inf"], "--cache-disk-gb"),
    (["--memory-ceiling-gb", "nan"], "--memory-ceiling-gb"),
    (["--upstream", "gpu-1:8000"], "--upstream"),
    (["--upstream", "ftp://gpu-1"], "--upstream"),
    (["--upstream", "http://"], "--upstream"),
    (["--upstream", "http://gpu-1:port"], "--upstream"),
])
def test_serve_rejects_out_of_range_numbers_and_malformed_upstreams(args, word):
    assert_clean_error(["serve", *args, "--print-config"], 2, word)


def test_serve_accepts_the_edges_of_the_ranges():
    result, text = invoke("serve", "--port", "0", "--cache-memory-gb", "0", "--upstream", "https://gpu-1:8000/v1",
                          "--print-config")
    assert result.exit_code == 0, text
    options = json.loads(result.stdout)["options"]
    assert options["port"]["value"] == 0 and options["upstreams"]["value"] == ["https://gpu-1:8000/v1"]


def test_serve_model_and_upstream_together_is_an_error(tmp_path):
    # --model used to be silently ignored. The --db in a missing directory only makes a
    # regression fail at once instead of serving forever inside the test.
    assert_clean_error(["serve", "--model", str(TINY_MODEL), "--upstream", "http://127.0.0.1:9",
                        "--db", str(tmp_path / "missing" / "t.db")], 2, "--model", "--upstream")


def _serve(args, cwd) -> subprocess.CompletedProcess:
    """`prefixtrace serve`, which must exit by itself; the generous timeout only catches a hang."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXTRACE_")}
    env.update(PYTHONPATH=str(ROOT), PREFIXTRACE_NO_OPENBLAS="1")
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", "serve", "--log-level", "warning", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=90)


@pytest.mark.slow
def test_serve_exits_naming_a_model_directory_that_is_not_a_model(tmp_path):
    # It used to listen anyway and answer 503 "still loading" forever.
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    proc = _serve(["--port", "0", "--model", str(not_a_model), "--db", str(tmp_path / "t.db")], tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "could not load model" in proc.stderr and "config.json" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_on_a_port_in_use_exits_non_zero(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _serve(["--port", str(port), "--upstream", "http://127.0.0.1:9", "--db", str(tmp_path / "t.db")],
                         tmp_path)
    assert proc.returncode != 0 and "already in use" in proc.stderr and "--port" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("config_json", [None, "{not json"])
def test_models_names_a_directory_that_is_not_a_model(tmp_path, config_json):
    model = tmp_path / "m"
    model.mkdir()
    if config_json is not None:
        (model / "config.json").write_text(config_json)
    assert_clean_error(["models", "--model", str(model)], 1, "not a model directory", "config.json")


# --- files: bad inputs, output paths that cannot be written -----------------------------------

@pytest.fixture
def truncated_db(tmp_path) -> Path:
    good = tmp_path / "good.db"
    assert invoke("import", str(FIXTURE), "--db", str(good))[0].exit_code == 0
    bad = tmp_path / "truncated.db"
    bad.write_bytes(good.read_bytes()[:5000])
    return bad


@pytest.mark.parametrize("command", [
    ["db", "info", "{db}"], ["export", "{db}"], ["analyze", "{db}"], ["check", "{db}"],
    ["replay", "{db}", "--target", "http://127.0.0.1:9"], ["import", str(FIXTURE), "--db", "{db}"],
])
def test_a_truncated_database_is_a_one_line_error_for_every_command(truncated_db, command):
    assert_clean_error([a.format(db=truncated_db) for a in command], 1, str(truncated_db.name), "malformed")


@pytest.mark.parametrize("command", [
    ["export", "{db}", "--out", "{out}"],
    ["analyze", str(FIXTURE), "--out", "{out}"],
    ["check", str(FIXTURE), "--junit", "{out}"],
    ["replay", str(FIXTURE), "--target", "http://127.0.0.1:9", "--out", "{out}"],
])
def test_an_output_file_in_a_missing_directory_is_refused_before_any_work(tmp_path, command):
    db = tmp_path / "t.db"
    assert invoke("import", str(FIXTURE), "--db", str(db))[0].exit_code == 0
    out = tmp_path / "no-such-dir" / "out.txt"
    assert_clean_error([a.format(db=db, out=out) for a in command], 2, "no-such-dir", "does not exist")
    assert not out.parent.exists()


def test_an_os_error_while_writing_is_a_one_line_error():
    @click.command()
    @library_errors
    def write():
        raise PermissionError(13, "Permission denied", "/srv/report.html")

    result = CliRunner().invoke(write, [])
    assert result.exit_code == 1 and "/srv/report.html: Permission denied" in result.output


@pytest.mark.parametrize("args, word", [
    (["analyze", str(FIXTURE), "--prefill-rate", "nan"], "--prefill-rate"),
    (["replay", str(FIXTURE), "--target", "http://127.0.0.1:9", "--pace", "original", "--max-gap", "-1"], "--max-gap"),
])
def test_analyze_and_replay_reject_meaningless_numbers(args, word):
    assert_clean_error(args, 2, word)


# --- the config file: a wrong type is rejected like the same value typed as a flag ------------

def config(clean_env, text: str) -> None:
    """The user's own config file (one found in the working directory may set fewer keys: test_run_trust.py)."""
    path = clean_env.parent / "home" / ".config" / "prefixtrace" / "prefixtrace.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("text, code, words", [
    ("[serve]\nport = 1.5\n", 2, ["--port", "1.5"]),  # used to become port 1
    ("[serve]\nport = true\n", 2, ["--port", "true"]),  # used to become port 1
    ("[serve]\nport = 70000\n", 2, ["--port"]),
    ("[serve]\nhost = [\"a\", \"b\"]\n", 1, ["prefixtrace.toml", "host", "not a list"]),  # used to become "['a', 'b']"
    ("[serve]\nhost = {a = 1}\n", 1, ["prefixtrace.toml", "host"]),
    ("[serve]\nupstream = [1, 2]\n", 2, ["--upstream", "'1'"]),
    ("serve = 1\n", 1, ["prefixtrace.toml", "[serve]", "table"]),  # used to say "no command 'serve'"
    ("config = \"other.toml\"\n", 1, ["prefixtrace.toml", "'config'"]),  # used to be silently ignored
    ("[db]\njson = true\n", 1, ["prefixtrace.toml", "[db.info]"]),  # used to say "expected one of: nothing"
])
def test_bad_config_values_are_clean_errors(clean_env, text, code, words):
    config(clean_env, text)
    assert_clean_error(["serve", "--print-config"] if "db" not in text else ["db", "info", "x.db"], code, *words)


def test_config_values_of_the_right_type_still_apply(clean_env):
    config(clean_env, '[serve]\nport = 9000\ncache-memory-gb = 4\nkv-dense-layers = [0, -1]\n'
                      'upstream = "http://gpu-1:8000"\n')
    result, text = invoke("serve", "--print-config")
    assert result.exit_code == 0, text
    options = json.loads(result.stdout)["options"]
    assert options["port"] == {"value": 9000, "source": "config"}
    assert options["cache_memory_gb"]["value"] == 4.0
    assert options["kv_dense_layers"]["value"] == [0, -1]
    assert options["upstreams"]["value"] == ["http://gpu-1:8000"]


def test_a_list_of_allowed_causes_in_the_config_file(clean_env):
    config(clean_env, '[check]\nallow = ["system_rewrite", "compaction"]\n')
    result, text = invoke("check", str(FIXTURE), "--json")
    assert result.exit_code == 0, text
    assert json.loads(result.stdout)["allow"] == ["compaction", "system_rewrite"]


def test_engine_options_with_upstream_are_named_as_ignored(monkeypatch):
    import prefixtrace.serve

    started = []
    monkeypatch.setattr(prefixtrace.serve, "serve", lambda config: started.append(config))
    monkeypatch.setenv("PREFIXTRACE_MAX_BATCH", "4")
    result, text = invoke("serve", "--upstream", "http://127.0.0.1:9", "--kv-quant", "turboquant")
    assert result.exit_code == 0 and started, text
    assert "--max-batch, --kv-quant only apply to the embedded engine" in text
    monkeypatch.delenv("PREFIXTRACE_MAX_BATCH")
    result, text = invoke("serve", "--upstream", "http://127.0.0.1:9")  # engine options at their defaults
    assert result.exit_code == 0 and "Warning" not in text

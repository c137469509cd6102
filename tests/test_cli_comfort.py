"""CLI comfort: config file and environment precedence, --json everywhere a table is printed,
progress only on a terminal."""

from __future__ import annotations

import inspect
import json
import os
import pty
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from prefixtrace.cli import cli
from prefixtrace.config import RESERVED_ENV, load_default_map
from prefixtrace.common.errors import InvalidRequest
from tests.conftest import ROOT

SESSIONS = ROOT / "fixtures" / "sessions"
FIXTURE = SESSIONS / "todo_stale.jsonl"


pytestmark = pytest.mark.usefixtures("clean_env")  # tests/conftest.py


def runner() -> CliRunner:
    # stdout alone, whatever click's version (8.1 mixes stderr in unless told not to).
    params = inspect.signature(CliRunner).parameters
    return CliRunner(**({"mix_stderr": False} if "mix_stderr" in params else {}))


def serve_options(*args, env=None) -> dict:
    result = runner().invoke(cli, [*args[:-1], args[-1], "--print-config"] if args else ["serve", "--print-config"],
                             env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def option(printed: dict, name: str) -> tuple:
    entry = printed["options"][name]
    return entry["value"], entry["source"]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- precedence: flag > env > config file > default ------------------------------------------

def test_serve_defaults_without_config_or_env():
    printed = serve_options()
    assert printed["config_file"] is None
    assert option(printed, "port") == (8765, "default")
    assert option(printed, "db") == ("prefixtrace.db", "default")
    assert option(printed, "upstreams") == ([], "default")


def test_user_config_then_working_directory_config_then_config_flag(tmp_path, clean_env):
    user = write(tmp_path / "home" / ".config" / "prefixtrace" / "prefixtrace.toml", "[serve]\nport = 9001\n")
    printed = serve_options()
    assert Path(printed["config_file"]) == user.resolve()
    assert option(printed, "port") == (9001, "config")

    local = write(clean_env / "prefixtrace.toml", "[serve]\nport = 9002\n")
    printed = serve_options()
    assert Path(printed["config_file"]) == local.resolve()
    assert option(printed, "port") == (9002, "config")  # the first file found wins; files are not merged

    other = write(tmp_path / "other.toml", "[serve]\nport = 9003\n")
    assert option(serve_options("--config", str(other), "serve"), "port") == (9003, "config")
    assert option(serve_options("serve", env={"PREFIXTRACE_CONFIG": str(other)}), "port") == (9003, "config")


def test_flag_beats_env_beats_config_beats_default(clean_env):
    write(clean_env.parent / "home" / ".config" / "prefixtrace" / "prefixtrace.toml",  # the user's own
          '[serve]\nport = 9100\nhost = "0.0.0.0"\ncache-memory-gb = 3\nupstream = "http://a:1"\n')
    printed = serve_options("serve", env={"PREFIXTRACE_PORT": "9200", "PREFIXTRACE_HOST": "127.0.0.2"})
    assert option(printed, "cache_memory_gb") == (3.0, "config")
    assert option(printed, "upstreams") == (["http://a:1"], "config")  # a lone string is a list of one
    assert option(printed, "port") == (9200, "env")
    assert option(printed, "db") == ("prefixtrace.db", "default")

    printed = serve_options("serve", "--port", "9300", env={"PREFIXTRACE_PORT": "9200"})
    assert option(printed, "port") == (9300, "flag")


def test_command_scoped_env_beats_the_short_one_and_repeatable_flags_split_on_spaces():
    printed = serve_options("serve", env={"PREFIXTRACE_SERVE_PORT": "9400", "PREFIXTRACE_PORT": "9200",
                                          "PREFIXTRACE_UPSTREAM": "http://a:1 http://b:2",
                                          "PREFIXTRACE_DB": "traffic.db"})
    assert option(printed, "port") == (9400, "env")
    assert option(printed, "upstreams") == (["http://a:1", "http://b:2"], "env")
    assert option(printed, "db") == ("traffic.db", "env")


def test_model_cache_root_variable_is_not_the_prefix_cache_dir(tmp_path):
    printed = serve_options("serve", env={"PREFIXTRACE_CACHE_DIR": str(tmp_path)})
    assert option(printed, "cache_dir") == (None, "default")
    printed = serve_options("serve", env={"PREFIXTRACE_SERVE_CACHE_DIR": str(tmp_path)})
    assert option(printed, "cache_dir") == (str(tmp_path), "env")


def test_every_option_names_its_env_var_in_help_and_none_is_reserved():
    def walk(group, path=()):
        for name, command in group.commands.items():
            yield (*path, name), command
            if hasattr(command, "commands"):
                yield from walk(command, (*path, name))

    for path, command in walk(cli):
        for param in command.params:
            if getattr(param, "envvar", None):
                assert not set(param.envvar) & RESERVED_ENV, (path, param.name)
                assert param.envvar[0] == "_".join(["PREFIXTRACE", *(p.upper() for p in path),
                                                    param.opts[0].lstrip("-").replace("-", "_").upper()])
    help_text = runner().invoke(cli, ["serve", "--help"]).stdout
    assert "PREFIXTRACE_PORT" in help_text and "PREFIXTRACE_SERVE_UPSTREAM" in help_text


def test_config_applies_to_other_commands_and_import_shares_prefixtrace_db(clean_env):
    write(clean_env / "prefixtrace.toml", '[analyze]\nformat = "json"\n')
    result = runner().invoke(cli, ["analyze", str(FIXTURE)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["sessions"][0]["turns"][1]["break"]["cause"] == "system_rewrite"

    result = runner().invoke(cli, ["import", str(FIXTURE), "--json"], env={"PREFIXTRACE_DB": "shared.db"})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["db"] == "shared.db" and (clean_env / "shared.db").is_file()


def test_nested_tables_and_dashed_or_underscored_keys_map_to_params(tmp_path):
    path = write(tmp_path / "c.toml", '[serve]\nmax_batch = 4\nkv-quant = "turboquant"\n'
                                      '[db.info]\njson = true\n[replay]\ntarget = ["http://a:1"]\n')
    assert load_default_map(path, cli) == {"serve": {"max_batch": 4, "kv_quant": "turboquant"},
                                           "db": {"info": {"as_json": True}},
                                           "replay": {"targets": ["http://a:1"]}}


@pytest.mark.parametrize("text, words", [
    ("[serve]\nprot = 1\n", ["[serve]", "'prot'", "port"]),
    ("[srve]\nport = 1\n", ["'srve'", "serve"]),
    ("[serve\n", ["line 1"]),
    ("[serve]\nprint-config = true\n", ["'print-config'"]),
])
def test_a_bad_config_file_is_a_clean_error_naming_the_file(clean_env, text, words):
    write(clean_env / "prefixtrace.toml", text)
    result = runner().invoke(cli, ["serve", "--print-config"])
    assert result.exit_code == 1
    message = result.output + (result.stderr if "mix_stderr" not in inspect.signature(CliRunner).parameters else "")
    assert "prefixtrace.toml" in message and all(w in message for w in words), message
    assert "Traceback" not in message


def test_a_bad_value_in_the_config_file_is_a_usage_error(clean_env):
    write(clean_env / "prefixtrace.toml", '[serve]\nport = "eighty"\n')
    result = runner().invoke(cli, ["serve", "--print-config"])
    assert result.exit_code == 2 and "port" in result.output


def test_missing_config_flag_file_is_an_error(tmp_path):
    with pytest.raises(InvalidRequest):
        from prefixtrace.config import find_config
        find_config(tmp_path / "absent.toml")
    assert runner().invoke(cli, ["--config", str(tmp_path / "absent.toml"), "serve", "--print-config"]).exit_code == 1


def test_documented_example_config_is_valid(tmp_path):
    text = (ROOT / "docs" / "CONFIG.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text, re.S)
    assert blocks
    for i, block in enumerate(blocks):
        assert load_default_map(write(tmp_path / f"example{i}.toml", block), cli)


# --- --json everywhere a table is printed ----------------------------------------------------

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_json_output_parses_for_every_table_printing_command(tmp_path):
    r = runner()
    db = tmp_path / "t.db"

    imported = r.invoke(cli, ["import", str(FIXTURE), "--db", str(db), "--json"])
    assert imported.exit_code == 0, imported.output
    assert json.loads(imported.stdout) == {"imported": 4, "file": str(FIXTURE), "db": str(db)}

    info = r.invoke(cli, ["db", "info", str(db), "--json"])
    assert info.exit_code == 0 and json.loads(info.stdout)["turns"] == 4

    out = tmp_path / "out.jsonl"
    exported = r.invoke(cli, ["export", str(db), "--out", str(out), "--json"])
    assert exported.exit_code == 0 and json.loads(exported.stdout)["exported"] == 4

    analyzed = r.invoke(cli, ["analyze", str(FIXTURE), "--json"])
    assert analyzed.exit_code == 0 and json.loads(analyzed.stdout)["sessions"]

    checked = r.invoke(cli, ["check", str(FIXTURE), "--json"])
    assert checked.exit_code == 1 and json.loads(checked.stdout)["ok"] is False

    model = tmp_path / "m"
    write(model / "config.json", json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    models = r.invoke(cli, ["models", "--model", str(model), "--json"])
    assert models.exit_code == 0 and json.loads(models.stdout)["model_type"] == "llama"

    replayed = r.invoke(cli, ["replay", str(FIXTURE), "--target", f"http://127.0.0.1:{_closed_port()}", "--json"])
    assert replayed.exit_code == 1  # the target is unreachable: named, and the report still parses
    report = json.loads(replayed.stdout)
    assert report["targets"][0]["error"] and len(report["targets"][0]["turns"]) == 4


def test_export_json_summary_goes_to_stderr_when_the_data_is_on_stdout(tmp_path):
    db = tmp_path / "t.db"
    assert runner().invoke(cli, ["import", str(FIXTURE), "--db", str(db)]).exit_code == 0
    proc = _run(["export", str(db), "--json"], tmp_path)
    assert len(proc.stdout.splitlines()) == 4
    assert json.loads(proc.stderr)["exported"] == 4


# --- progress: on a terminal only -------------------------------------------------------------

def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXTRACE_")}
    return {**env, "PYTHONPATH": str(ROOT), "TERM": "xterm-256color", "COLUMNS": "100"}


def _run(args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=120)


def _run_with_terminal_stderr(args, cwd) -> tuple[int, str, str]:
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "prefixtrace.cli", *args], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks: list[bytes] = []

    def drain():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed its end
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    stdout, _ = proc.communicate(timeout=120)
    reader.join(timeout=10)
    os.close(master)
    return proc.returncode, stdout, b"".join(chunks).decode(errors="replace")


def _long_work(tmp_path) -> list[list[str]]:
    db = tmp_path / "p.db"
    return [["import", str(FIXTURE), "--db", str(db)],
            ["analyze", str(FIXTURE)],
            ["replay", str(FIXTURE), "--target", f"http://127.0.0.1:{_closed_port()}"]]


@pytest.mark.slow
def test_no_progress_output_when_stderr_is_not_a_terminal(tmp_path):
    for args in _long_work(tmp_path):
        proc = _run(args, tmp_path)
        assert proc.returncode in (0, 1), proc.stderr
        lines = [line for line in proc.stderr.splitlines() if not line.startswith("Error: target")]
        assert lines == [], (args, proc.stderr)
        assert "\x1b" not in proc.stdout


@pytest.mark.slow
def test_progress_is_drawn_on_a_terminal_and_stdout_stays_clean(tmp_path):
    labels = ["importing", "analyzing", "replaying"]
    for args, label in zip(_long_work(tmp_path), labels):
        code, stdout, stderr = _run_with_terminal_stderr([*args, "--json"], tmp_path)
        assert code in (0, 1), stderr
        assert label in stderr, (args, stderr)
        json.loads(stdout)

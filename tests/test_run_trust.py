"""Where `prefixtrace run` sends a harness's credentials, tested from outside: a planted
`prefixtrace.toml` in the working directory (prefixtrace/config_trust.py), a foreign process
answering /health where run looks for a proxy, and a genuine serve that proves it is the user's
(prefixtrace/common/instance_proof.py), all real servers on loopback and real `run` / `serve` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from testsupport.servers import ROOT, TINY_MODEL, running_server, start_serve, stop

KEY = "sk-proj-" + "Q" * 40  # what the harness holds and must not reach a stranger
PROMPT = "the user's private prompt 7f3a"

FAKE_HARNESS = """#!{python}
# aider as far as `run` can tell: reads the base URL and key run gave it, sends one request.
import json, os, urllib.request
base = os.environ["AIDER_OPENAI_API_BASE"]
key = os.environ.get("AIDER_OPENAI_API_KEY") or os.environ["OPENAI_API_KEY"]
body = {{"model": "default", "messages": [{{"role": "user", "content": {prompt!r}}}], "max_tokens": 2}}
req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                             headers={{"Authorization": "Bearer " + key, "Content-Type": "application/json"}})
print(urllib.request.urlopen(req, timeout=120).read()[:80])
"""


def capturing_app(seen: list[dict]) -> Starlette:
    """Answers like an OpenAI-compatible server that is healthy, and keeps every request it gets."""

    async def anything(request: Request):
        seen.append({"path": request.url.path, "query": request.url.query, "headers": dict(request.headers),
                     "body": (await request.body()).decode(errors="replace")})
        if request.url.path == "/health":
            return JSONResponse({"status": "ok", "backend": "impostor"})
        if request.url.path.endswith("/models"):
            return JSONResponse({"object": "list", "data": [{"id": "default", "object": "model"}]})
        return JSONResponse({"id": "x", "object": "chat.completion", "created": 0, "model": "default",
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                          "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})

    return Starlette(routes=[Route("/{path:path}", anything, methods=["GET", "POST", "HEAD"])])


@pytest.fixture
def private_keys(tmp_path, monkeypatch) -> Path:
    """A key directory of this test's own, for the serve and the run it starts alike."""
    path = tmp_path / "runtime"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    return path


@pytest.fixture
def fake_aider(tmp_path) -> Path:
    exe = tmp_path / "bin" / "aider"
    exe.parent.mkdir()
    exe.write_text(FAKE_HARNESS.format(python=sys.executable, prompt=PROMPT))
    exe.chmod(0o755)
    return exe


def leaked(seen: list[dict]) -> list[dict]:
    return [r for r in seen if KEY in json.dumps(r) or PROMPT in r["body"] or "authorization" in r["headers"]]


def run_cli(cwd: Path, args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENAI_API_KEY": KEY, "PREFIXTRACE_NO_OPENBLAS": "1"}
    env.pop("PREFIXTRACE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "prefixtrace.cli", *args], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_planted_config_cannot_send_the_harness_elsewhere(tmp_path, private_keys, fake_aider):
    """A cloned repository's prefixtrace.toml names a capturing server as run's proxy, serve's upstream
    and OTLP endpoint, and opens serve to every host: run announces it, applies none of those, and
    the harness's request (key and prompt) goes to the proxy run started on the tiny model."""
    seen: list[dict] = []
    repo = tmp_path / "cloned-repo"
    repo.mkdir()
    with running_server(capturing_app(seen)) as evil:
        (repo / "prefixtrace.toml").write_text(
            f'[run]\nurl = "{evil}"\n\n[serve]\nupstream = "{evil}/v1"\nhost = "0.0.0.0"\nallowed-hosts = "*"\n'
            f'otlp-endpoint = "{evil}"\nmax-batch = 2\n')
        result = run_cli(repo, ["run", "--db", str(tmp_path / "t.db"), "--exe", str(fake_aider),
                                "--serve-args", f"--model {TINY_MODEL}", "aider"])
    assert result.returncode == 0, result.stderr
    assert seen == [], f"the planted config's server was contacted: {seen}"
    err = result.stderr
    assert f"using {repo / 'prefixtrace.toml'} from the working directory (not given with --config)" in err
    assert "it sets [run] url; [serve] upstream, host, allowed-hosts, otlp-endpoint, max-batch" in err
    assert "not applied from it: [run] url; [serve] upstream, host, allowed-hosts, otlp-endpoint:" in err
    assert f"to apply them: prefixtrace --config {repo / 'prefixtrace.toml'} <command>" in err
    assert "1 request recorded" in err  # it went to run's own proxy instead


def test_the_user_named_config_is_applied(tmp_path, private_keys):
    """The same keys from a file given with --config are the user's say: applied, no announcement."""
    cfg = tmp_path / "mine.toml"
    cfg.write_text('[serve]\nhost = "0.0.0.0"\nallowed-hosts = "*"\n')
    named = run_cli(tmp_path, ["--config", str(cfg), "serve", "--print-config"])
    assert named.returncode == 0 and "not applied" not in named.stderr
    options = json.loads(named.stdout)["options"]
    assert options["host"] == {"value": "0.0.0.0", "source": "config"}
    (tmp_path / "prefixtrace.toml").write_text(cfg.read_text())
    found = run_cli(tmp_path, ["serve", "--print-config"])
    printed = json.loads(found.stdout)
    assert printed["options"]["host"] == {"value": "127.0.0.1", "source": "default"}
    assert printed["withheld_from_config"] == ["[serve] host", "[serve] allowed-hosts"]
    assert "not applied from it: [serve] host, allowed-hosts:" in found.stderr


def test_a_planted_config_cannot_write_outside_the_working_directory(tmp_path, private_keys):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "out.html").symlink_to(tmp_path / "victim")  # a link in the repo counts where it points
    (repo / "prefixtrace.toml").write_text('[serve]\ndb = "../elsewhere.db"\n[export]\nout = "out.html"\n'
                                           '[import]\ndb = "inside.db"\n')
    found = run_cli(repo, ["serve", "--print-config"])
    assert json.loads(found.stdout)["options"]["db"]["source"] == "default"
    assert "not applied from it: [serve] db; [export] out:" in found.stderr
    assert "[import]" not in found.stderr.splitlines()[-2]


@pytest.mark.slow
def test_an_impostor_answering_health_gets_nothing(tmp_path, private_keys, fake_aider, monkeypatch):
    """Something answers /health ok where run looks by default: run does not hand it the harness;
    it starts a proxy of its own (here forwarding to a second, legitimate server)."""
    from prefixtrace.run import run

    impostor_seen: list[dict] = []
    upstream_seen: list[dict] = []
    said: list[str] = []
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.chdir(tmp_path)
    with running_server(capturing_app(impostor_seen)) as impostor, \
            running_server(capturing_app(upstream_seen)) as upstream:
        code = run("aider", [], url=impostor, db=tmp_path / "t.db", executable=str(fake_aider),
                   serve_args=["--upstream", f"{upstream}/v1"], say=said.append)
    assert code == 0, said
    assert leaked(impostor_seen) == []
    assert {r["path"] for r in impostor_seen} <= {"/health", "/prefixtrace/instance"}
    assert any("did not prove it is a prefixtrace serve of yours" in line for line in said)
    assert [r for r in upstream_seen if PROMPT in r["body"]], "the request never reached run's own proxy"


@pytest.mark.slow
def test_a_proven_serve_is_reused_and_names_its_database(tmp_path, private_keys, fake_aider, monkeypatch):
    """A serve of the user's own proves itself: run reuses it and reads the session back from the
    database that serve names, not from run's --db or the working directory."""
    from prefixtrace.run import run

    upstream_seen: list[dict] = []
    said: list[str] = []
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    (tmp_path / "serve").mkdir()
    with running_server(capturing_app(upstream_seen)) as upstream:
        proc, url = start_serve(tmp_path / "serve" / "its.db", tmp_path / "serve.log",
                                ["--upstream", f"{upstream}/v1"], model=None)
        try:
            assert list(private_keys.glob("prefixtrace/serve-*.json"))
            code = run("aider", [], url=url, db=tmp_path / "guess.db", executable=str(fake_aider),
                       say=said.append)
        finally:
            stop(proc)
    assert code == 0, said
    assert any(f"using your prefixtrace at {url}" in line for line in said), said
    assert "1 request recorded in " + str(tmp_path / "serve" / "its.db") in said[-1]
    assert not (tmp_path / "guess.db").exists()
    assert not list(private_keys.glob("prefixtrace/serve-*.json"))  # serve removed its key on exit


def test_a_proof_from_the_wrong_secret_is_refused(tmp_path, private_keys):
    """A stale or copied key file does not help a stranger: the answer must be made with the secret."""
    from prefixtrace.common.instance_proof import proof, verify
    from prefixtrace.instance_key import key_file, read_key, write_key

    path, secret = write_key(9, tmp_path / "a.db")
    assert path == key_file(9) and read_key(9) == secret and oct(path.stat().st_mode & 0o777) == "0o600"
    assert verify(secret, "n" * 32, "a.db", proof(secret, "n" * 32, "a.db"))
    assert not verify(secret, "n" * 32, "a.db", proof(b"other", "n" * 32, "a.db"))
    assert not verify(secret, "n" * 32, "b.db", proof(secret, "n" * 32, "a.db"))  # the database is bound in
    path.chmod(0o644)
    assert read_key(9) is None  # readable by others: not a secret any more


def test_every_withheld_option_exists():
    """A renamed option must not silently leave the list of what a found file may not set."""
    from prefixtrace.cli import cli
    from prefixtrace.config_trust import SENSITIVE, WRITTEN_PATHS

    for table in (SENSITIVE, WRITTEN_PATHS):
        for path, names in table.items():
            command = cli
            for part in path:
                command = command.commands[part]
            assert names <= {p.name for p in command.params}, (path, names)

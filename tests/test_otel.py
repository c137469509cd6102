"""OpenTelemetry export (prefixtrace/otel.py, docs/OBSERVABILITY.md), end to end: a real
`prefixtrace serve --otlp-endpoint` subprocess on the tiny model, a few turns of one session with a
cache break and a refused request, the spans read back by an OTLP/HTTP receiver on loopback
(testsupport/otlp_receiver.py) and compared with what the proxy recorded (its database) and analysed (its
dashboard's JSON); then `analyze --otlp-endpoint` over that recording."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from tests.conftest import ROOT, TINY_MODEL, free_port
from testsupport.otlp_receiver import OtlpReceiver

pytest.importorskip("opentelemetry.sdk.trace", reason="the [otel] extra (it is in the test extra)")

SESSION = "otel-session-1"
SECRET_WORDS = "ZebraQuokka"  # in a prompt: must never reach a span


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _serve(args: list[str], cwd: Path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "prefixtrace.cli", "serve", "--port", str(port), *args], cwd=cwd,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def healthy():
        if proc.poll() is not None:
            raise AssertionError(f"serve exited early:\n{proc.stdout.read()}")
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, 120, "serve to be healthy")
    return proc, url


def _stop(proc) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def _chat(url: str, system: str, messages: list[dict]) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"X-Session-Id": SESSION},
                   json={"model": "default", "max_tokens": 4, "temperature": 0, "stream": True,
                         "messages": [{"role": "system", "content": system}, *messages]})
    assert r.status_code == 200, r.text
    return r


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One serve run: three turns of one session (append, append, then a changed system prompt) and a
    refused request; the spans the receiver got, the recorded turns and the dashboard's analysis."""
    from recorder.reader import iter_turns

    tmp = tmp_path_factory.mktemp("otel")
    db = tmp / "otel.db"
    with OtlpReceiver() as receiver:
        proc, url = _serve(["--model", str(TINY_MODEL), "--db", str(db), "--otlp-endpoint", receiver.url], tmp)
        try:
            system = f"You are a terse assistant. Codeword {SECRET_WORDS}."
            history = [{"role": "user", "content": "Say hi."}]
            _chat(url, system, history)
            history += [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again."}]
            _chat(url, system, history)
            # The system prompt changes: the whole prefix is re-prefilled (a break).
            _chat(url, "You are a verbose assistant, and today is Tuesday.", history)
            refused = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"X-Session-Id": SESSION},
                                 json={"model": "default", "messages": "not a list"})
            assert refused.status_code == 400
            wait_for(lambda: len(receiver.spans) >= 4, 30, "4 spans")
            dashboard = httpx.get(url + "/ui/api/sessions", timeout=30).json()
        finally:
            log = _stop(proc)
        turns = list(iter_turns(db))
        spans = receiver.by_request_id()
    return {"turns": turns, "spans": spans, "dashboard": dashboard, "db": db, "log": log}


@pytest.mark.slow
def test_serve_exports_one_span_per_turn_with_the_genai_attributes(served):
    turns, spans = served["turns"], served["spans"]
    assert len(turns) == 4 and set(spans) == {t.request_id for t in turns}, served["log"][-3000:]
    for turn in turns:
        span = spans[turn.request_id]
        a = span["attributes"]
        assert a["gen_ai.conversation.id"] == SESSION
        assert a["gen_ai.operation.name"] == "chat"
        assert a["http.response.status_code"] == turn.status
        assert span["resource"]["service.name"] == "prefixtrace"
        assert span["start_ns"] == int(turn.started_at * 1e9)
        if turn.status >= 400:
            assert span["status"] == 2  # STATUS_CODE_ERROR
            assert a["error.type"] == "400"
            continue
        assert span["name"] == "chat default"
        assert a["gen_ai.provider.name"] == a["gen_ai.system"] == "prefixtrace"
        assert a["gen_ai.request.model"] == "default"
        assert a["gen_ai.response.model"] == "tiny-llama"
        assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0
        # Values equal to what the proxy recorded; input tokens include the cached ones.
        assert a["gen_ai.usage.input_tokens"] == turn.prompt_tokens
        assert a["gen_ai.usage.output_tokens"] == turn.completion_tokens
        assert a["gen_ai.usage.cache_read.input_tokens"] == turn.cached_tokens
        assert a["gen_ai.usage.cache_read.input_tokens"] <= a["gen_ai.usage.input_tokens"]
        assert a["gen_ai.response.finish_reasons"] == [turn.finish_reason]
        assert a["prefixtrace.ttft_s"] == turn.ttft_s and a["prefixtrace.total_s"] == turn.total_s
        assert span["end_ns"] - span["start_ns"] == pytest.approx(turn.total_s * 1e9, abs=2)
    # The second turn extended the first, so the engine served its prefix from cache.
    ok = [t for t in turns if t.status < 400]
    assert spans[ok[1].request_id]["attributes"]["gen_ai.usage.cache_read.input_tokens"] > 0


@pytest.mark.slow
def test_serve_spans_carry_the_live_analysis(served):
    """The break's cause, cost and fix are the dashboard's own (proxy/live.py), not a second analysis."""
    turns, spans = served["turns"], served["spans"]
    (session,) = [s for s in served["dashboard"]["sessions"] if s["id"] == SESSION]
    analysed = {t["request_id"]: t["analysis"] for t in session["turns"]}
    ok = [t for t in turns if t.status < 400]
    assert [spans[t.request_id]["attributes"]["prefixtrace.turn.number"] for t in ok] == [1, 2, 3]
    assert [spans[t.request_id]["attributes"]["prefixtrace.prefix_stable"] for t in ok] == [True, True, False]
    for turn in ok:
        a, live = spans[turn.request_id]["attributes"], analysed[turn.request_id]
        assert a["prefixtrace.reprefill_tokens"] == live["reprefill_tokens"]
        if live["break"] is None:
            assert "prefixtrace.break.cause" not in a
            continue
        assert a["prefixtrace.break.cause"] == live["break"]["cause"]
        assert a.get("prefixtrace.break.subtype") == live["break"]["subtype"]
        assert a["prefixtrace.fix"] == live["break"]["suggestion"] and a["prefixtrace.fix"]
        assert a["prefixtrace.lost_tokens"] == live["lost_tokens"] > 0
        assert a.get("prefixtrace.lost_seconds") == live["lost_seconds"]
        assert a["prefixtrace.lost_seconds.basis"] == live["lost_seconds_basis"]
    assert spans[ok[2].request_id]["attributes"]["prefixtrace.break.cause"]


@pytest.mark.slow
def test_no_prompt_text_reaches_a_span(served):
    text = json.dumps([s["attributes"] for s in served["spans"].values()])
    assert SECRET_WORDS not in text and "Tuesday" not in text and "Say hi" not in text


@pytest.mark.slow
def test_analyze_exports_the_recording(served):
    """`analyze --otlp-endpoint` over the recording: one span per turn, at the recorded time, with the
    report's own analysis (the same values its --format json prints)."""
    db, turns = served["db"], served["turns"]
    out = db.parent / "report.json"
    with OtlpReceiver() as receiver:
        result = CliRunner().invoke(__import__("prefixtrace.cli", fromlist=["cli"]).cli,
                                    ["analyze", str(db), "--format", "json", "--out", str(out),
                                     "--otlp-endpoint", receiver.url])
        assert result.exit_code == 0, result.output
        assert f"exported 4 spans to {receiver.url}/v1/traces" in result.output
        spans = receiver.by_request_id()
    assert set(spans) == {t.request_id for t in turns}
    report = json.loads(out.read_text())
    (session,) = report["sessions"]
    for analysed in session["turns"]:
        span = spans[analysed["request_id"]]
        a = span["attributes"]
        turn = next(t for t in turns if t.request_id == analysed["request_id"])
        assert span["start_ns"] == int(turn.started_at * 1e9)
        assert span["end_ns"] - span["start_ns"] == pytest.approx(turn.total_s * 1e9, abs=2)
        assert a["gen_ai.conversation.id"] == session["id"] == SESSION
        assert a["gen_ai.usage.input_tokens"] == turn.prompt_tokens
        assert a["gen_ai.usage.cache_read.input_tokens"] == turn.cached_tokens
        assert a["prefixtrace.turn.number"] == analysed["number"]
        assert a["prefixtrace.reprefill_tokens"] == analysed["reprefill_tokens"]
        brk = analysed["break"]
        assert a.get("prefixtrace.break.cause") == (brk and brk["cause"])
        if brk:
            assert a["prefixtrace.lost_tokens"] == analysed["lost_tokens"]
            assert a.get("prefixtrace.lost_seconds") == analysed["lost_seconds"]
            assert a["prefixtrace.fix"] == brk["suggestion"]
    # The refused request is not chained by the analysis but still gets its span.
    (failed,) = report["failed_requests"]
    assert spans[failed["request_id"]]["status"] == 2
    # The same break named the same way live and after the fact.
    live = {rid: s["attributes"].get("prefixtrace.break.cause") for rid, s in served["spans"].items()}
    assert {rid: s["attributes"].get("prefixtrace.break.cause") for rid, s in spans.items()} == live


@pytest.mark.slow
def test_analyze_says_when_nothing_could_be_exported(served, tmp_path):
    from prefixtrace.cli import cli

    port = free_port()  # nothing listens there
    result = CliRunner().invoke(cli, ["analyze", str(served["db"]), "--format", "json", "--out",
                                      str(tmp_path / "r.json"), "--otlp-endpoint", f"http://127.0.0.1:{port}"])
    assert result.exit_code == 1
    assert f"4 of 4 spans could not be exported to http://127.0.0.1:{port}/v1/traces" in result.output


BLOCK_OTEL = ("import sys; sys.modules['opentelemetry'] = None; from prefixtrace.cli import main; "
              "sys.argv[0] = 'prefixtrace'; main()")


@pytest.mark.slow
@pytest.mark.parametrize("command", [["serve", "--model", str(TINY_MODEL)], ["analyze", "SRC"]])
def test_without_the_extra_the_flag_fails_in_one_line(command, served, tmp_path):
    command = [str(served["db"]) if c == "SRC" else c for c in command]
    port = free_port()
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-c", BLOCK_OTEL, *command, "--port" if command[0] == "serve" else "--json",
                        *([str(port)] if command[0] == "serve" else []), "--otlp-endpoint", "http://127.0.0.1:4318"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'prefixtrace[otel]'" in lines[0], r.stderr
    assert r.stdout == ""  # analyze wrote no report either: refused before any work
    assert time.monotonic() - started < 60


def test_a_bad_endpoint_is_refused_in_one_line(tmp_path):
    from prefixtrace.cli import cli

    result = CliRunner().invoke(cli, ["serve", "--port", str(free_port()), "--db", str(tmp_path / "x.db"),
                                      "--otlp-endpoint", "localhost:4318"])
    assert result.exit_code != 0
    assert "--otlp-endpoint must be an http(s) URL" in result.output


@pytest.mark.slow
def test_nothing_but_prefixtrace_otel_imports_opentelemetry():
    importers = []
    for folder in ("prefixtrace", "proxy", "engine", "recorder", "analyzer"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n.split(".")[0] == "opentelemetry" for n in names):
                    importers.append(str(path.relative_to(ROOT)))
    assert sorted(set(importers)) == ["prefixtrace/otel.py"]
    # And serving without the flag loads none of the extra (the API alone may come with FastAPI's own
    # optional telemetry module, which imports it when it is installed).
    code = ("import sys, prefixtrace.cli, prefixtrace.serve, proxy.app, prefixtrace.otel; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def _phoenix() -> str | None:
    """A Phoenix install to test against: PREFIXTRACE_PHOENIX (its `phoenix` executable), else one on PATH.
    Not in the test extra: ~0.85 GB of packages, ~1.5 min to start here (docs/OBSERVABILITY.md)."""
    import shutil

    return os.environ.get("PREFIXTRACE_PHOENIX") or shutil.which("phoenix")


@pytest.mark.slow
@pytest.mark.skipif(_phoenix() is None, reason="Arize Phoenix is not installed (PREFIXTRACE_PHOENIX=/path/to/phoenix)")
def test_phoenix_receives_the_spans(served, tmp_path):
    """A real collector: Arize Phoenix on loopback takes `analyze --otlp-endpoint`'s spans over OTLP/HTTP
    and gives them back through its REST API with our attributes, and reads the GenAI usage as its own."""
    from prefixtrace.cli import cli

    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PHOENIX_HOST": "127.0.0.1", "PHOENIX_PORT": str(port), "PHOENIX_GRPC_PORT": str(grpc_port),
           "PHOENIX_WORKING_DIR": str(tmp_path / "phoenix")}
    proc = subprocess.Popen([_phoenix(), "serve"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        def up():
            assert proc.poll() is None, "phoenix exited"
            try:
                return httpx.get(url + "/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 300, "Phoenix to start")
        result = CliRunner().invoke(cli, ["analyze", str(served["db"]), "--json", "--out", str(tmp_path / "r.json"),
                                          "--otlp-endpoint", url])
        assert result.exit_code == 0, result.output

        def spans():
            data = httpx.get(url + "/v1/projects/default/spans", params={"limit": 100}, timeout=10).json()["data"]
            return data if len(data) >= 4 else None

        got = {s["attributes"]["prefixtrace.request_id"]: s for s in wait_for(spans, 60, "Phoenix to list 4 spans")}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    ours = served["spans"]
    assert set(got) == set(ours)
    # What `analyze` priced, by request: it counts with the server's recorded renderer, the live
    # analysis behind serve's spans with the generic one, so a break's lost tokens come from the report.
    report = json.loads((tmp_path / "r.json").read_text())
    lost = {t["request_id"]: t.get("lost_tokens") for s in report["sessions"] for t in s["turns"]}
    for rid, span in got.items():
        a, sent = span["attributes"], ours[rid]["attributes"]
        for key in ("gen_ai.conversation.id", "gen_ai.usage.input_tokens", "gen_ai.usage.cache_read.input_tokens",
                    "prefixtrace.break.cause"):
            assert a.get(key) == sent.get(key), key
        assert a.get("prefixtrace.lost_tokens") == lost.get(rid), rid
        if sent["http.response.status_code"] < 400:
            assert span["span_kind"] == "LLM"  # Phoenix recognised a GenAI span
            assert a["llm.token_count.prompt"] == sent["gen_ai.usage.input_tokens"]
        else:
            assert span["status_code"] == "ERROR"


def test_an_upstream_messages_turn_reads_as_anthropic_with_cache_writes():
    """Attributes of a turn an Anthropic-shaped upstream answered: the recorded prompt_tokens already
    include cache reads and writes (prefixtrace/wire/messages.py), the writes come from its usage, the
    provider is the protocol's, and the upstream URL's credentials stay hidden."""
    from prefixtrace.otel import span_name, turn_attributes
    from recorder.turn import Turn

    turn = Turn("r1", 1_700_000_000.0, "/v1/messages", "http://user:pw@gpu-1:8000", {"model": "claude-x"},
                status=200, prompt_tokens=1200, cached_tokens=1000, completion_tokens=7, finish_reason="end_turn",
                usage={"input_tokens": 50, "cache_read_input_tokens": 1000, "cache_creation_input_tokens": 150,
                       "output_tokens": 7}, ttft_s=0.5, total_s=0.9)
    a = turn_attributes(turn, None, None)
    assert a["gen_ai.provider.name"] == "anthropic" and "gen_ai.response.model" not in a
    assert a["gen_ai.usage.input_tokens"] == 1200 == 50 + 1000 + 150
    assert a["gen_ai.usage.cache_read.input_tokens"] == 1000
    assert a["gen_ai.usage.cache_creation.input_tokens"] == 150
    assert a["prefixtrace.upstream"] == "http://***@gpu-1:8000"
    assert "gen_ai.conversation.id" not in a and "prefixtrace.turn.number" not in a
    assert span_name(a) == "chat claude-x"
    unknown = turn_attributes(Turn("r2", 1.0, "/v1/chat/completions", "http://x", {}, status=200), None, "s")
    assert not any(k.startswith("gen_ai.usage") for k in unknown)  # unknown is left out, never 0


@pytest.mark.slow
def test_a_collector_that_is_down_costs_no_response(tmp_path):
    """Nothing listens at the endpoint: requests are answered as usual, and serve still stops promptly
    (the export retries off the response path, bounded at shutdown)."""
    proc, url = _serve(["--model", str(TINY_MODEL), "--db", str(tmp_path / "d.db"),
                        "--otlp-endpoint", f"http://127.0.0.1:{free_port()}"], tmp_path)
    try:
        for _ in range(3):
            started = time.monotonic()
            _chat(url, "You are terse.", [{"role": "user", "content": "hi"}])
            assert time.monotonic() - started < 30
        time.sleep(1.5)  # the feed has analysed them and the batch exporter is retrying
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        started = time.monotonic()
        log = _stop(proc)
    assert proc.returncode is not None and time.monotonic() - started < 25, log[-2000:]
    assert "OTLP export to" in log and "failed" in log


def test_analyze_of_bare_bodies_exports_only_what_has_a_time(tmp_path):
    """Bare request bodies carry neither an id nor a time: no span is made up for them (not at the
    import's 'now', not twice), and a wrapped record with a time gets exactly one."""
    from prefixtrace.cli import cli

    system = [{"role": "system", "content": "a"}]
    lines = [{"model": "m", "messages": [*system, {"role": "user", "content": "hi"}]},
             {"id": "r2", "ts": 1_700_000_000.5, "session": "s", "request":
              {"model": "m", "messages": [{"role": "system", "content": "b"}, {"role": "user", "content": "hi"}]}}]
    src = tmp_path / "bodies.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    with OtlpReceiver() as receiver:
        result = CliRunner().invoke(cli, ["analyze", str(src), "--json", "--otlp-endpoint", receiver.url])
        assert result.exit_code == 0, result.output
        assert "exported 1 span" in result.output
        spans = receiver.by_request_id()
    assert list(spans) == ["r2"]
    assert spans["r2"]["start_ns"] == int(1_700_000_000.5 * 1e9)
    assert spans["r2"]["attributes"]["gen_ai.conversation.id"] == "s"


def test_upstream_mode_spans_read_the_upstreams_usage(tmp_path):
    """The proxy in front of a scripted Anthropic-shaped upstream on loopback (the real proxy app and
    backend, in-process): each turn's span says anthropic, CLIENT, and the usage the upstream sent,
    cache reads and writes included, equal to what the proxy recorded."""
    from fastapi import FastAPI

    from prefixtrace.otel import LiveFeed, TurnSpans
    from proxy.app import create_app
    from proxy.upstream_backend import UpstreamBackend
    from recorder.reader import iter_turns
    from recorder.store import Recorder
    from tests.conftest import running_server

    upstream = FastAPI()

    @upstream.post("/v1/messages")
    async def messages(body: dict):
        return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-scripted-1",
                "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 20, "cache_read_input_tokens": 900, "cache_creation_input_tokens": 80,
                          "output_tokens": 3}}

    with OtlpReceiver() as receiver, Recorder(tmp_path / "up.db") as rec:
        feed = LiveFeed(TurnSpans.open(receiver.url), quiet_s=0.05)
        with running_server(upstream) as up_url, \
                running_server(create_app(UpstreamBackend(up_url), rec, turn_feed=feed)) as url:
            messages = [{"role": "user", "content": "hi"}]
            for _ in range(2):
                r = httpx.post(url + "/v1/messages", timeout=30, headers={"X-Session-Id": "up-1"},
                               json={"model": "claude-x", "max_tokens": 8, "system": "Be brief.", "messages": messages})
                assert r.status_code == 200, r.text
                messages = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
            wait_for(lambda: len(receiver.spans) >= 2, 30, "2 spans")
        feed.close()
        rec.flush()
        turns = list(iter_turns(rec.path))
        spans = receiver.by_request_id()
    assert len(turns) == 2 and set(spans) == {t.request_id for t in turns}
    for turn in turns:
        span = spans[turn.request_id]
        a = span["attributes"]
        assert span["kind"] == 3  # SPAN_KIND_CLIENT: an upstream answered
        assert a["gen_ai.provider.name"] == "anthropic" and a["gen_ai.request.model"] == "claude-x"
        assert a["gen_ai.usage.input_tokens"] == turn.prompt_tokens == 20 + 900 + 80
        assert a["gen_ai.usage.cache_read.input_tokens"] == turn.cached_tokens == 900
        assert a["gen_ai.usage.cache_creation.input_tokens"] == 80
        assert a["gen_ai.usage.output_tokens"] == 3
        assert a["gen_ai.conversation.id"] == "up-1" and a["prefixtrace.upstream"] == up_url
    assert sorted(s["attributes"]["prefixtrace.turn.number"] for s in spans.values()) == [1, 2]

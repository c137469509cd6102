"""Bounded memory and time for any input (issue 25, findings 2, 3, 7, 9, 14), driven from outside:
a real uvicorn on 127.0.0.1 as `serve` configures it, raw sockets, the recorder's SQLite."""

from __future__ import annotations

import gzip
import json
import logging
import os
import select
import socket
import sqlite3
import struct
import threading
import time
import zlib
from pathlib import Path

import httpx
import pytest

from prefixtrace.serve import uvicorn_config
from proxy.app import create_app
from proxy.engine_backend import EngineBackend
from recorder import iter_turns
from tests.conftest import free_port, start_uvicorn

BODY_TIMEOUT_S = 1.5
CHAT = b"/v1/chat/completions"


def _chat(content: str = "hi", **extra) -> bytes:
    return json.dumps({"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": content}],
                       **extra}).encode()


@pytest.fixture
def server(tiny_engine, recorder):
    """The proxy on the tiny model under `serve`'s uvicorn config: a 1 MB body limit, a 1.5 s body
    deadline, the default head limit. Yields (port, recorder)."""
    app = create_app(EngineBackend(tiny_engine), recorder, max_request_mb=1)
    app.state.request_body_timeout_s = BODY_TIMEOUT_S
    port = free_port()
    uv, thread = start_uvicorn(uvicorn_config(app, "127.0.0.1", port, "warning"))
    try:
        yield port, recorder
    finally:
        uv.should_exit = True
        thread.join(10)


def _connect(port: int, timeout: float = 30) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def _head(headers: list[bytes], path: bytes = CHAT) -> bytes:
    base = [b"POST " + path + b" HTTP/1.1", b"Host: 127.0.0.1", b"Content-Type: application/json"]
    return b"\r\n".join(base + headers) + b"\r\n\r\n"


def _response(sock: socket.socket, deadline_s: float = 30) -> tuple[int, dict, bytes]:
    """Status, headers and body of one response (Content-Length framed), read from `sock`."""
    sock.settimeout(deadline_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response head: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:]))
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed inside the response body"
        body += chunk
    return int(lines[0].split()[1]), headers, body[:length]


def _closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Whether the server closes `sock` within `within_s` (what it still sends is read and dropped)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if sock.recv(65536) == b"":
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def _turns(rec, n: int, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while True:
        assert rec.flush(30)
        turns = list(iter_turns(rec.path))
        if len(turns) >= n or time.monotonic() > deadline:
            return turns
        time.sleep(0.05)


def _normal_request(port: int) -> int:
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=_chat(), timeout=60,
                      headers={"Content-Type": "application/json"}).status_code


# --- finding 3: a request head has a limit --------------------------------------------------------

def test_a_30_mb_header_is_a_431_recorded_without_it_and_the_connection_closed(server):
    port, rec = server
    db_before = os.path.getsize(rec.path)
    body = _chat()
    sock = _connect(port)
    sock.sendall(_head([b"Content-Length: %d" % len(body), b"X-Session-Id: big-head"])[:-2])  # the head goes on

    def send_giant_header():
        try:
            sock.sendall(b"X-Giant: " + b"g" * (30 << 20) + b"\r\n\r\n" + body)
        except OSError:
            pass  # the server stopped reading it: that is the point

    sender = threading.Thread(target=send_giant_header, daemon=True)
    sender.start()
    status, headers, answer = _response(sock)
    sender.join(30)
    sock.close()
    assert status == 431, answer
    error = json.loads(answer)["error"]
    assert error["code"] == "request_header_fields_too_large" and "64 KB" in error["message"]
    assert headers.get("connection") == "close"
    (turn,) = _turns(rec, 1)
    assert turn.status == 431 and turn.endpoint == "/v1/chat/completions"
    assert "x-giant" not in turn.request_headers and "x-prefixtrace-head-refused" not in turn.request_headers
    assert turn.request_headers.get("x-session-id") == "big-head"  # the headers before it are kept
    assert "g" * 1000 not in json.dumps(turn.request_headers) + str(turn.request_body)
    assert os.path.getsize(rec.path) - db_before < 1 << 20
    assert _normal_request(port) == 200


def test_a_head_over_the_limit_in_one_write_is_a_431_too(server):
    port, rec = server
    body = _chat()
    with _connect(port) as sock:  # head and body in one write, likely one read: the head is whole, and too big
        sock.sendall(_head([b"Content-Length: %d" % len(body), b"X-Small: kept", b"X-Big: " + b"b" * (100 << 10)])
                     + body)
        status, headers, answer = _response(sock)
        assert _closed_by_peer(sock, 5)
    assert status == 431, answer
    (turn,) = _turns(rec, 1)
    assert turn.status == 431 and turn.request_headers.get("x-small") == "kept" and "x-big" not in turn.request_headers


def test_headers_under_the_limit_are_served_and_a_client_cannot_forge_the_refusal_marker(server):
    port, rec = server
    body = _chat()
    with _connect(port) as sock:
        sock.sendall(_head([b"Content-Length: %d" % len(body), b"X-Prefixtrace-Head-Refused: forged",
                            b"X-Padding: " + b"p" * (40 << 10)]) + body)
        status, _, answer = _response(sock)
    assert status == 200, answer
    (turn,) = _turns(rec, 1)
    assert "x-prefixtrace-head-refused" not in turn.request_headers and len(turn.request_headers["x-padding"]) == 40 << 10


# --- finding 7: compressed and huge bodies ----------------------------------------------------------

def test_a_gzip_body_is_decoded_and_recorded_as_json(server):
    port, rec = server
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=gzip.compress(_chat("zipped hello")),
                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}, timeout=60)
    assert r.status_code == 200, r.text
    (turn,) = _turns(rec, 1)
    assert turn.status == 200 and turn.request_body["messages"][0]["content"] == "zipped hello"


def test_a_gzip_body_is_forwarded_upstream_decoded(chain):
    url_a, rec_a, rec_b = chain
    r = httpx.post(url_a + "/v1/chat/completions", content=gzip.compress(_chat("through two proxies")),
                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"}, timeout=60)
    assert r.status_code == 200, r.text
    (turn_b,) = _turns(rec_b, 1)
    assert turn_b.request_body["messages"][0]["content"] == "through two proxies"
    assert "content-encoding" not in turn_b.request_headers  # the body it got is the decoded one


def _gzip_bomb(prefix: bytes, megabytes: int) -> bytes:
    """A valid gzip stream of `prefix` and `megabytes` MB of "0": each MB deflated once after a full flush
    (which makes every such block the same bytes) and repeated, so it is built in ~1 s, not compressed."""
    packer = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    zeros = b"0" * (1 << 20)
    head = packer.compress(prefix) + packer.flush(zlib.Z_FULL_FLUSH)
    block = packer.compress(zeros) + packer.flush(zlib.Z_FULL_FLUSH)
    assert block == packer.compress(zeros) + packer.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(prefix)
    for _ in range(megabytes + 1):
        crc = zlib.crc32(zeros, crc)
    size = len(prefix) + (megabytes + 1) * len(zeros)
    return (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + head + block * (megabytes + 1) + packer.flush()
            + struct.pack("<II", crc, size & 0xFFFFFFFF))


def test_a_gzip_bomb_is_a_413_at_the_decoded_limit(server):
    port, rec = server
    payload = _gzip_bomb(_chat("x")[:-1] + b', "pad": "', 512)  # JSON up to a string that ends past the limit
    assert len(payload) < 1 << 20  # under the 1 MB limit on the wire, 512 MB decoded
    started = time.monotonic()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=payload, timeout=60,
                   headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    elapsed = time.monotonic() - started
    assert r.status_code == 413, r.text
    assert "gzip-decoded" in r.json()["error"]["message"]
    (turn,) = _turns(rec, 1)
    assert turn.status == 413 and turn.request_body.startswith("[request body not stored:")
    assert elapsed < 20, elapsed  # decoded only to the limit (unbounded, it was 25 s and 4.3 GB)
    assert _normal_request(port) == 200


def test_an_unread_content_encoding_is_a_415(server):
    port, rec = server
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=b"\x0b\x02\x80{}\x03", timeout=60,
                   headers={"Content-Type": "application/json", "Content-Encoding": "br"})
    assert r.status_code == 415 and "'br'" in r.json()["error"]["message"]
    (turn,) = _turns(rec, 1)
    assert turn.status == 415


def test_a_declared_5_gb_body_is_refused_unread_and_its_connection_closed(server):
    port, rec = server
    with _connect(port) as sock:
        sock.sendall(_head([b"Content-Length: %d" % (5 << 30)]) + b'{"messages": [')
        status, headers, answer = _response(sock)
        assert status == 413 and b"5120.0 MB" in answer
        assert headers.get("connection") == "close"  # said, so no client sends its next request here
        stop = time.monotonic() + 10  # a client that goes on sending is cut off, not read at its pace
        closed = False
        while time.monotonic() < stop and not closed:
            try:
                sock.sendall(b"a" * 65536)
            except OSError:
                closed = True
                break
            if select.select([sock], [], [], 0.05)[0]:
                closed = _closed_by_peer(sock, 0.1)
        assert closed, "the server went on reading a 5 GB body it had refused"
    (turn,) = _turns(rec, 1)
    assert turn.status == 413


# --- finding 9: hang-ups and trickles ----------------------------------------------------------------

def test_a_hang_up_mid_body_is_recorded_as_499_without_a_traceback(server, caplog):
    port, rec = server
    caplog.set_level(logging.INFO)
    with _connect(port) as sock:
        sock.sendall(_head([b"Content-Length: 10000"]) + b'{"model": "default", "messages": [')
        time.sleep(0.3)
    (turn,) = _turns(rec, 1)
    assert turn.status == 499, (turn.status, turn.error)
    assert "client disconnected while sending the request body" in turn.error
    assert "Traceback" not in caplog.text and "ClientDisconnect" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_trickled_bodies_get_a_408_at_the_deadline_and_cannot_pile_up(server):
    port, rec = server
    socks = []
    for _ in range(60):
        s = _connect(port)
        s.sendall(_head([b"Content-Length: 5000"]) + b'{"model": ')
        socks.append(s)
    answered: dict[int, int] = {}
    started = time.monotonic()
    while len(answered) < len(socks) and time.monotonic() - started < BODY_TIMEOUT_S + 20:
        for i, s in enumerate(socks):
            if i in answered:
                continue
            if select.select([s], [], [], 0)[0]:
                answered[i] = _response(s)[0]
            else:
                try:
                    s.sendall(b" ")  # one byte at a time: never the whole body
                except OSError:
                    answered[i] = -1
        time.sleep(0.1)
    assert _normal_request(port) == 200  # served beside them
    assert sorted(set(answered.values())) == [408], answered
    assert sum(_closed_by_peer(s, 5) for s in socks) == len(socks)  # and their connections closed
    for s in socks:
        s.close()
    turns = _turns(rec, len(socks) + 1)
    assert sorted(t.status for t in turns) == [200] + [408] * len(socks)
    assert all(t.request_body.startswith("[request body not stored:") for t in turns if t.status == 408)


# --- finding 14: transfer-codings and trailers -------------------------------------------------------

def _chunked(body: bytes, trailers: bytes = b"") -> bytes:
    return b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, trailers)


def test_a_transfer_coding_other_than_chunked_is_a_501(server):
    port, rec = server
    with _connect(port) as sock:
        sock.sendall(_head([b"Transfer-Encoding: gzip, chunked"]) + _chunked(_chat()))
        status, headers, answer = _response(sock)
    assert status == 501, answer
    assert json.loads(answer)["error"]["code"] == "unsupported_transfer_coding"
    (turn,) = _turns(rec, 1)
    assert turn.status == 501 and turn.request_body.startswith("[request body not read:")


def test_chunked_trailers_are_not_recorded_as_headers(server):
    port, rec = server
    with _connect(port) as sock:
        sock.sendall(_head([b"Transfer-Encoding: chunked"])
                     + _chunked(_chat(), b"X-Trailer-Note: trailer-value\r\n"))
        status, _, answer = _response(sock)
    assert status == 200, answer
    (turn,) = _turns(rec, 1)
    assert "x-trailer-note" not in turn.request_headers
    assert "trailer-value" not in json.dumps(turn.request_headers)


# --- finding 2: a prompt that cannot fit (the real SmolLM2 tokenizer) ---------------------------------

def _memory_mb(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) // 1024
    return fields


def _recorded(db: Path) -> int:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute("SELECT count(*) FROM turn_log").fetchone()[0]
    finally:
        con.close()


def _timed_post(url: str, pid: int, body: bytes, db: Path) -> tuple[httpx.Response, float, int, int]:
    """The response, its time, and the server's peak RSS growth (MB; the peak is reset first) over the
    answer and then through its turn's commit (a big refusal is answered before its turn is written)."""
    recorded = _recorded(db)
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _memory_mb(pid)["VmRSS"]
    started = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"},
                   timeout=300)
    answered_s, answer_peak = time.monotonic() - started, _memory_mb(pid)["VmHWM"] - before
    deadline = time.monotonic() + 120
    while _recorded(db) == recorded and time.monotonic() < deadline:
        time.sleep(0.01)
    return r, answered_s, answer_peak, _memory_mb(pid)["VmHWM"] - before


@pytest.mark.slow
def test_a_30_mb_prompt_is_refused_without_tokenizing_it_and_its_memory_returned(tmp_path):
    """Side by side on one server: a 30 MB prompt is refused in < 2 s with < 200 MB of peak growth, its
    turn's write (redaction and insert of 30 MB, which any 30 MB body pays) included in the memory and
    done after the answer; not tokenized (95 s and +4 GB before)."""
    from tests.test_cli_serve import serve_process

    text = "The quick brown fox jumps over the lazy dog.\n" * (30_000_000 // 45)
    prompt = json.dumps({"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": text}]})
    in_metadata = json.dumps({"model": "default", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                              "metadata": {"note": text}})
    db = tmp_path / "prefixtrace.db"
    with serve_process([], cwd=tmp_path, ready_timeout=300) as (url, proc):  # the bundled SmolLM2
        assert httpx.post(url + "/v1/chat/completions", content=_chat(), timeout=120,
                          headers={"Content-Type": "application/json"}).status_code == 200
        time.sleep(1)
        start_rss = _memory_mb(proc.pid)["VmRSS"]
        plain, plain_s, _, plain_peak = _timed_post(url, proc.pid, in_metadata.encode(), db)
        time.sleep(1)
        refused, refused_s, refused_answer_peak, refused_peak = _timed_post(url, proc.pid, prompt.encode(), db)
        time.sleep(1)
        after_one = _memory_mb(proc.pid)["VmRSS"]
        again, again_s, _, again_peak = _timed_post(url, proc.pid, prompt.replace("quick", "quiet", 1).encode(), db)
        time.sleep(1)
        after_two = _memory_mb(proc.pid)["VmRSS"]
    print(f"30 MB body in metadata: {plain_s:.2f} s, peak +{plain_peak} MB; 30 MB prompt: {refused_s:.2f} s, "
          f"peak +{refused_answer_peak} MB at the answer, +{refused_peak} MB through its commit; again "
          f"{again_s:.2f} s, +{again_peak} MB; RSS {start_rss} -> {after_one} -> {after_two} MB")
    assert plain.status_code == 200, plain.text[:300]
    assert refused.status_code == 400 and again.status_code == 400
    # Before tokenizing was bounded: 209.5 s, peak +4,750 MB, RSS 816 -> 3,382 -> 3,442 MB. Before the
    # answer stopped waiting for the write: 2.02 s / +256 MB, again 1.75 s / +199 MB on a quiet machine.
    assert refused_s < 2 and again_s < 2, (refused_s, again_s)
    assert refused_peak < 200 and again_peak < 200, (refused_peak, again_peak)
    assert refused_peak < plain_peak + 100, (refused_peak, plain_peak)  # one rendered copy more, no tokens
    assert after_two - after_one < 50, (after_one, after_two)  # what one took is given back, not piled up
    error = refused.json()["error"]
    assert error["code"] == "context_exceeds_capacity" and error["max_context_tokens"] <= 8192
    assert error["prompt_tokens_at_least"] > 8192 and "can never fit" in error["message"]


# --- the bound that refuses a prompt untokenized never refuses one that fits ---------------------------

def _adversarial_texts() -> list[str]:
    import random

    rng = random.Random(25)
    shared = Path(__file__).resolve().parent.parent.parent / "shared" / "traffic"
    real = [p.read_text(errors="replace")[:200_000] for p in sorted(shared.glob("*"))[:3] if p.is_file()]
    return [
        "#" * 50_000, " " * 50_000, "\n" + " " * 80 * 600, "=" * 40_000, "<|im_start|>" * 3000, "<|endoftext|>" * 3000,
        "héllo wörld ", "🙂" * 10_000, "\u200b" * 10_000, "0123456789" * 5000,
        "".join(rng.choice("ab #=\n\t-") for _ in range(60_000)),
        "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(30_000)),
        *real,
    ]


def _check_bound(tokenizer, monkeypatch) -> None:
    from engine import chat_render
    from engine.chat_render import encode_within, token_bound

    monkeypatch.setattr(chat_render, "EXACT_BELOW_CHARS", 1000)  # the bound and the chunked count are what run

    bound = token_bound(tokenizer)
    assert bound is not None and bound.unit == "bytes"  # byte-level BPE: every token is at most max_units bytes
    for text in _adversarial_texts():
        tokens = len(tokenizer.encode(text, add_special_tokens=False))
        assert tokens >= bound.at_least(text), (text[:30], tokens, bound)
        # just fits: neither the bound nor the chunked count refuses it, and the ids are the tokenizer's own
        assert encode_within(tokenizer, text, tokens + 1, bound, add_special_tokens=False) == \
            list(tokenizer.encode(text, add_special_tokens=False))


def test_the_token_bound_holds_on_adversarial_text_for_the_tiny_tokenizer(monkeypatch):
    from transformers import AutoTokenizer

    from tests.conftest import TINY_MODEL

    _check_bound(AutoTokenizer.from_pretrained(str(TINY_MODEL)), monkeypatch)


@pytest.mark.slow
def test_the_token_bound_holds_on_adversarial_text_for_smollm2(monkeypatch):
    from transformers import AutoTokenizer

    from engine.default_model import default_model_dir

    _check_bound(AutoTokenizer.from_pretrained(str(default_model_dir())), monkeypatch)


def test_chunked_counting_refuses_early_and_tokenizers_without_a_proof_get_no_bound():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from engine.chat_render import PromptOverLimit, encode_within, token_bound
    from tests.conftest import TINY_MODEL

    tiny = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    calls = []
    real_encode = tiny.encode

    def counting(text, **kw):
        calls.append(len(text))
        return real_encode(text, **kw)

    tiny.encode = counting
    text = "The quick brown fox jumps over the lazy dog.\n" * 200_000  # 9 MB
    with pytest.raises(PromptOverLimit) as over:
        encode_within(tiny, text, 2048, None, add_special_tokens=False)  # no bound: counted in chunks
    assert over.value.counted and over.value.at_least >= 2048
    assert sum(calls) < 300_000, "counting went on past the limit"
    # A tokenizer that drops text (whitespace split) or fuses unknowns is not given a bound.
    dropping = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[], unk_token=None))
    dropping.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert token_bound(PreTrainedTokenizerFast(tokenizer_object=dropping)) is None
    fused = Tokenizer(models.BPE(vocab={"a": 0, "<unk>": 1}, merges=[], unk_token="<unk>", fuse_unk=True))
    assert token_bound(PreTrainedTokenizerFast(tokenizer_object=fused)) is None


def test_count_tokens_counts_past_the_context_and_refuses_a_huge_prompt_early(engine_server):
    url, rec = engine_server  # the default 32 MB body limit
    context = httpx.get(url + "/v1/capacity", timeout=30).json()["max_context_tokens"]

    def count(text: str) -> httpx.Response:
        return httpx.post(url + "/v1/messages/count_tokens", timeout=60, json={
            "model": "default", "messages": [{"role": "user", "content": text}]})

    over = count("word " * int(1.5 * context))  # cannot run, still counted exactly
    assert over.status_code == 200 and over.json()["input_tokens"] > context, over.text
    huge = count("word " * (50 * context))  # ~8 MB
    assert huge.status_code == 400, huge.text
    error = huge.json()["error"]
    assert error["code"] == "context_exceeds_capacity" and error["prompt_tokens_at_least"] > 4 * context


@pytest.mark.slow
def test_serve_takes_the_body_deadline_and_the_head_limit_from_its_options(tmp_path):
    from tests.conftest import TINY_MODEL
    from tests.test_cli_serve import serve_process

    args = ["--model", str(TINY_MODEL), "--request-body-timeout-s", "1", "--max-header-kb", "2"]
    with serve_process(args, cwd=tmp_path, env={"PREFIXTRACE_NO_OPENBLAS": "1"}) as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        with _connect(port) as sock:
            sock.sendall(_head([b"Content-Length: 100"]) + b"{")
            started = time.monotonic()
            status, _, _ = _response(sock)
            assert status == 408 and time.monotonic() - started < 10
        with _connect(port) as sock:
            sock.sendall(_head([b"Content-Length: 2", b"X-Pad: " + b"p" * 3000]) + b"{}")
            assert _response(sock)[0] == 431

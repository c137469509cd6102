import json
import sqlite3

import pytest

from prefixtrace.errors import InvalidRequest
from recorder import REDACTED, Recorder, Redactor, Turn, iter_turns

OPENAI_KEY = "sk-proj-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
ANTHROPIC_KEY = "sk-ant-api03-ZyXwVuTsRqPoNmLkJiHgFeDcBa9876543210"
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
BEARER = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N"
COOKIE = "sessionid=c00kiev4lue-very-private"


def test_credential_headers_dropped_case_insensitively():
    headers = {
        "Authorization": f"Bearer {OPENAI_KEY}",
        "PROXY-AUTHORIZATION": "Basic Zm9vOmJhcg==",
        "X-Api-Key": ANTHROPIC_KEY,
        "api-key": "azure-key-value",
        "Cookie": COOKIE,
        "Set-Cookie": COOKIE,
        "Content-Type": "application/json",
        "X-Custom": f"token {OPENAI_KEY}",
    }
    assert Redactor().headers(headers) == {"Content-Type": "application/json", "X-Custom": f"token {REDACTED}"}


def test_default_patterns():
    r = Redactor()
    assert r.text(f"key={OPENAI_KEY}.") == f"key={REDACTED}."
    assert r.text(ANTHROPIC_KEY) == REDACTED
    assert r.text(f"aws {AWS_KEY} done") == f"aws {REDACTED} done"
    assert r.text(f"Authorization: Bearer {BEARER}") == f"Authorization: {REDACTED}"
    assert r.text("remote https://x:ghp_" + "a1B2c3D4e5" * 4 + "@github.com") == f"remote https://x:{REDACTED}@github.com"
    assert r.text("GH=github_pat_11ABCDEFG0" + "x" * 40) == f"GH={REDACTED}"
    assert r.text("slack xoxb-1234567890-abcdefghij done") == f"slack {REDACTED} done"
    assert r.text("key=AIza" + "Sy" * 17 + "Q") == f"key={REDACTED}"
    pem = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk\nAAAA==\n-----END OPENSSH PRIVATE KEY-----"
    assert r.text(f"cat id_ed25519\n{pem}\n$ ") == f"cat id_ed25519\n{REDACTED}\n$ "


def test_prose_is_not_redacted():
    text = ("Bearer tokens are explained in sk-learn docs; AKIA is a prefix; ghp_ starts a GitHub token; "
            "-----BEGIN PUBLIC KEY----- is fine.")
    assert Redactor().text(text) == text


def test_nested_values_and_keys_are_redacted():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": f"use {OPENAI_KEY}"}]}], OPENAI_KEY: 1}
    out = Redactor().value(body)
    assert OPENAI_KEY not in json.dumps(out)
    assert out["messages"][0]["content"][0]["text"] == f"use {REDACTED}"


def test_custom_patterns_replace_defaults():
    r = Redactor([r"ghp_[A-Za-z0-9]{10,}"])
    assert r.text("ghp_abcdefghijklmnop and " + OPENAI_KEY) == f"{REDACTED} and {OPENAI_KEY}"


def test_bad_pattern_raises_invalid_request():
    with pytest.raises(InvalidRequest, match="redaction pattern"):
        Redactor(["(unclosed"])


def test_secrets_never_reach_the_db_file(tmp_path):
    db = tmp_path / "t.db"
    secrets = [OPENAI_KEY, ANTHROPIC_KEY, AWS_KEY, BEARER, COOKIE, "azure-key-value"]
    turn = Turn(
        request_id="r1",
        started_at=1.0,
        endpoint="/v1/chat/completions",
        upstream="u",
        request_body={
            "model": "m",
            "messages": [{"role": "user", "content": f"deploy with {OPENAI_KEY} and {AWS_KEY}, Bearer {BEARER}"}],
        },
        request_headers={
            "authorization": f"Bearer {OPENAI_KEY}",
            "x-api-key": ANTHROPIC_KEY,
            "Api-Key": "azure-key-value",
            "cookie": COOKIE,
        },
        response_text=f"I will use {ANTHROPIC_KEY}",
        tool_calls=[{"function": {"name": "sh", "arguments": json.dumps({"env": AWS_KEY})}}],
        error=f"upstream said: bad key {OPENAI_KEY}",
    )
    rec = Recorder(db)
    rec.record(turn)
    rec.flush()

    def raw_bytes() -> bytes:
        return b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.name.startswith("t.db"))

    assert (tmp_path / "t.db-wal").exists()
    data = raw_bytes()  # main file + -wal while the writer is still open
    for secret in secrets:
        assert secret.encode() not in data, secret
    rec.close()
    data = raw_bytes()  # after the checkpoint into the main file
    for secret in secrets:
        assert secret.encode() not in data, secret

    headers = sqlite3.connect(db).execute("select request_headers from turns").fetchone()[0]
    assert json.loads(headers) == {}
    (stored,) = iter_turns(db)
    assert REDACTED in stored.request_body["messages"][0]["content"]


def test_raw_body_text_is_redacted_too(tmp_path):
    db = tmp_path / "t.db"
    plain = '{"model":"m","messages":[{"role":"user","content":"key %s"}]}' % OPENAI_KEY
    # the same key spelled with a JSON escape: invisible to the text regexes,
    # so the recorder must fall back to the redacted, re-serialised body
    escaped = plain.replace(OPENAI_KEY, "\\u0073" + OPENAI_KEY[1:])
    with Recorder(db) as rec:
        for i, raw in enumerate([plain, escaped]):
            turn = Turn(request_id=f"r{i}", started_at=float(i), endpoint="/v1/chat/completions", upstream="u",
                        request_body=json.loads(raw), request_raw=raw)
            rec.record(turn)
    stored = list(iter_turns(db))
    assert stored[0].request_raw == plain.replace(OPENAI_KEY, REDACTED)  # still the client's spelling
    for t in stored:
        assert t.request_body["messages"][0]["content"] == f"key {REDACTED}"
    data = b"".join(p.read_bytes() for p in tmp_path.iterdir())
    assert OPENAI_KEY[3:].encode() not in data

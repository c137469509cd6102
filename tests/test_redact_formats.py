"""Issue 25, finding 10: secrets in formats outside the old list are redacted in the database,
the JSONL export and the HAR export; ordinary code text is left alone; redaction stays linear.

Each format goes where a client puts it (a message, the model's echo of it, a header value), is
recorded by a real `Recorder`, and the database files and both exports are then read as bytes.
One request carrying all of them also goes through a real proxy on 127.0.0.1.
"""

from __future__ import annotations

import json

import httpx
import pytest

from recorder import REDACTED, Recorder, Redactor, Turn
from recorder.sources import export

# (id, text as a client would paste it, the part that must not be stored)
FORMATS = [
    ("postgres-url", "DATABASE_URL=postgres://app:PgS3cretPw77@db.internal:5432/app", "PgS3cretPw77"),
    ("mysql-url", "mysql://root:MyS3cretPw77@127.0.0.1:3306/shop", "MyS3cretPw77"),
    ("mongodb-url", "mongodb+srv://admin:MgS3cretPw77@cluster0.ab1cd.mongodb.net/test", "MgS3cretPw77"),
    ("redis-url", "redis://:RdS3cretPw77@cache:6379/0", "RdS3cretPw77"),
    ("https-url", "git clone https://deploy:HtS3cretPw77@git.example.com/repo.git", "HtS3cretPw77"),
    ("bearer-lowercase", "curl -H 'authorization: bearer lcBearerTok3n0123456789abcdef'", "lcBearerTok3n0123456789abcdef"),
    ("authorization-basic", 'curl -H "Authorization: Basic QmFzaWNVc2VyOkJhc2ljUHc3Nw=="', "QmFzaWNVc2VyOkJhc2ljUHc3Nw"),
    ("google-ya29", "access token ya29.a0AfH6SMBGoogleTok3n0123456789abc", "a0AfH6SMBGoogleTok3n0123456789abc"),
    ("azure-account-key", "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=QXp1cmVBY2NvdW50S2V5U2VjcmV0Nzc="
                          ";EndpointSuffix=core.windows.net", "QXp1cmVBY2NvdW50S2V5U2VjcmV0Nzc"),
    ("azure-sas-sig", "https://acct.blob.core.windows.net/c/b?sv=2021-06-08&sp=r&sig=AzSasSig0123%2BSecret77%3D",
     "AzSasSig0123%2BSecret77"),
    ("slack-webhook", "https://hooks.slack.com/services/T01ABCDEF/B02GHIJKL/SlackHookS3cret0123456789",
     "SlackHookS3cret0123456789"),
    ("sendgrid", "SENDGRID_API_KEY_VALUE SG.SendGridId0123456789ab.SendGridS3cret0123456789abcdefghijklmnopqrs",
     "SendGridS3cret0123456789abcdefghijklmnopqrs"),
    ("twilio-sk", "twilio api key SK0123456789abcdef0123456789abcdef in use", "SK0123456789abcdef0123456789abcdef"),
    ("pypi", "password for upload: see token pypi-AgEIcHlwaS5vcmcPyPiS3cretToken0123456789abcdefghijklmnopqrstu",
     "AgEIcHlwaS5vcmcPyPiS3cretToken0123456789abcdefghijklmnopqrstu"),
    ("discord-bot", "client.run('MTIzNDU2Nzg5MDEyMzQ1Njc4.GaBcDe.DiscordS3cretHmac0123456789abcdefg')",
     "DiscordS3cretHmac0123456789abcdefg"),
    ("telegram-bot", "TELEGRAM 123456789:AAHdqTelegramS3cret0123456789abcdef end", "AAHdqTelegramS3cret0123456789abcdef"),
    ("vault-hvs", "export VAULT_TOKEN_VALUE hvs.CAESIVaultS3cretToken0123456789ab", "CAESIVaultS3cretToken0123456789ab"),
    ("netrc", "machine api.example.com login bob password N3trcS3cretPw77", "N3trcS3cretPw77"),
    ("netrc-lines", "machine api.example.com\n  login bob\n  password N3trcS3cretPw78\n", "N3trcS3cretPw78"),
    ("docker-auth", '{"auths": {"registry.example.com": {"auth": "RG9ja2VyVXNlcjpEb2NrZXJQdzc3"}}}',
     "RG9ja2VyVXNlcjpEb2NrZXJQdzc3"),
    # Vendor-prefixed tokens (each a made-up value in the vendor's documented shape).
    ("stripe-whsec", "STRIPE_WEBHOOK_SECRET=whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"),
    ("gitlab-glrt", "gitlab-runner register --token glrt-t3_AbCdEfGhIjKlMnOpQrStUv", "t3_AbCdEfGhIjKlMnOpQrStUv"),
    ("gitlab-gldt", "git clone https://gitlab+deploy-token-1:gldt-AbCdEfGhIjKlMnOpQrSt@gitlab.com/g/p.git",
     "AbCdEfGhIjKlMnOpQrSt"),
    ("digitalocean", "doctl auth init -t dop_v1_" + "0123456789abcdef" * 4, "0123456789abcdef" * 4),
    ("shopify", "X-Shopify-Access-Token value shpat_0123456789abcdef0123456789abcdef", "0123456789abcdef0123456789abcdef"),
    ("google-client-secret", '"client_secret_value": "GOCSPX-AbCdEfGhIjKlMnOpQrStUvWxYz12"', "AbCdEfGhIjKlMnOpQrStUvWxYz12"),
    ("atlassian", "JIRA token ATATT3xFfGF0AbCdEfGhIjKlMnOpQrStUvWxYz0123456789=ABCD1234",
     "xFfGF0AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"),
    ("linear", "LINEAR lin_api_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789AbCd", "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789AbCd"),
    ("groq", "GROQ gsk_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789AbCdEfGhIjKlMnOp", "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789AbCdEf"),
    ("xai", "XAI xai-" + "AbCdEfGhIjKlMnOpQrStUvWxYz012345" * 3, "AbCdEfGhIjKlMnOpQrStUvWxYz012345" * 2),
    ("replicate", "REPLICATE r8_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789a", "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789a"),
    ("slack-xapp", "SLACK_APP xapp-1-A0123ABCDEF-1234567890123-0123456789abcdef0123456789abcdef",
     "A0123ABCDEF-1234567890123-0123456789abcdef"),
    ("aws-session-token", "aws sts: FwoGZXIvYXdzEBYaDAbCdEfGhIjKlMnOpQrStUvWxYz0123456789+/AbCdEfGhIjKlMnOp==",
     "EBYaDAbCdEfGhIjKlMnOpQrStUvWxYz0123456789"),
    ("aws-session-token-new", "IQoJb3JpZ2luX2VjEAbCdEfGhIjKlMnOpQrStUvWxYz0123456789+/AbCdEfGhIjKlMn",
     "EAbCdEfGhIjKlMnOpQrStUvWxYz0123456789"),
    ("aws-session-token-env", "export AWS_SESSION_TOKEN=SessTok3nValueWithoutAPrefix0123456789",
     "SessTok3nValueWithoutAPrefix0123456789"),
    ("age", "# created: 2026\nAGE-SECRET-KEY-1" + "QPZRY9X8GF2TVDW0S3JN54KHCE6MUA7L"[:29] * 2,
     "QPZRY9X8GF2TVDW0S3JN54KHCE6MUQPZRY9X8GF2TVDW0S3JN54KHCE6MU"),
    ("databricks", "DATABRICKS dapi0123456789abcdef0123456789abcdef-2", "dapi0123456789abcdef0123456789abcdef"),
    ("postman", "POSTMAN PMAK-0123456789abcdef01234567-0123456789abcdef0123456789abcdef01",
     "0123456789abcdef01234567-0123456789abcdef0123456789abcdef01"),
    ("discord-webhook", "https://discord.com/api/webhooks/123456789012345678/DiscordHookS3cret0123456789abcdefgh",
     "DiscordHookS3cret0123456789abcdefgh"),
    ("sentry-dsn", "SENTRY_DSN=https://0123456789abcdef0123456789abcdef@o123456.ingest.sentry.io/1234567",
     "0123456789abcdef0123456789abcdef"),
    ("mailgun", "MAILGUN key-0123456789abcdef0123456789abcdef end", "0123456789abcdef0123456789abcdef"),
    ("grafana", "GRAFANA glsa_AbCdEfGhIjKlMnOpQrStUvWxYz012345_0123abcd", "AbCdEfGhIjKlMnOpQrStUvWxYz012345"),
    ("kubeconfig", "users:\n- name: admin\n  user:\n    client-key-data: LS0tLS1CRUdJTiBSU0EgUFJJVkFURSBLRVktLS0tLQo=\n",
     "LS0tLS1CRUdJTiBSU0EgUFJJVkFURSBLRVktLS0tLQo"),
    ("fcm-server-key", "FCM AAAAbCdEfGh:APA91b" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789_-" * 4,
     "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789_-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789_-"),
    ("terraform", "TFE_TOKEN AbCdEfGhIjKlMn.atlasv1." + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789" * 2,
     "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789AbCdEfGhIjKlMnOpQrStUvWxYz"),
]

# Credential header names outside the dropped list that say they carry one.
CREDENTIAL_HEADERS = ["DD-APPLICATION-KEY", "X-Master-Key", "X-Access-Key", "X-Key", "Signature"]

# Ordinary code and prose that looks a little like the above and must come back unchanged.
NEGATIVES = [
    "postgres://localhost:5432/app",
    "http://localhost:8080/v1/models?limit=10",
    "The Authorization header uses basic auth; see RFC 7617.",
    "He was the bearer of bad news.",
    "sig=sign(payload, key)",
    "SKU 1234, SKIP_TESTS=1",
    "the login form has a password field",
    '{"auth": "oauth2", "author": "Jane"}',
    "def connect(url='mysql://user@host/db'): pass",
    "time 12:30:45 on 2024-01-01",
    "email bob@example.com or see https://github.com/org/repo@main",
    "git@github.com:org/repo.git and ssh://git@github.com/org/repo.git",
    "version 1.2.3 of module.sub.attr",
    "for i in range(10): print(i)",
    # Near the new formats: words and identifiers that share a prefix but are no token.
    "a key-value store; monkey-patch the key-0123 field",
    "whsec_ is Stripe's webhook prefix; gsk_test and r8_abc are placeholders",
    "the glrt- prefix marks runner tokens; see dop_v1_ in the docs",
    "import discord; discord.com/api/webhooks is documented",
    "Sentry DSN https://public@sentry.example.com/1",
    "AAAA records map a name to an IPv6 address",
    "aws_session_token: str = None",
    "client-key-data: <base64 of your key>",
    "the app.atlasv1 module and xai-grok docs",
    "Idempotency-Key headers make retries safe",
]


def _turn(i: int, text: str, headers: dict[str, str] | None = None) -> Turn:
    return Turn(request_id=f"r{i}", started_at=float(i), endpoint="/v1/chat/completions", upstream="u",
                session_id="s", status=200, request_body={"model": "m", "messages": [{"role": "user", "content": text}]},
                request_headers=headers if headers is not None else {"X-Note": text},
                response_text=f"you said: {text}")


def _all_bytes(paths) -> bytes:
    return b"".join(p.read_bytes() for p in paths)


def _record_and_export(tmp_path, turns: list[Turn]) -> tuple[bytes, bytes, bytes]:
    db = tmp_path / "t.db"
    with Recorder(db) as rec:
        for turn in turns:
            rec.record(turn)
        assert rec.flush(30)
        db_bytes = _all_bytes(p for p in tmp_path.iterdir() if p.name.startswith("t.db"))  # with the -wal
    db_bytes += db.read_bytes()
    jsonl, har = tmp_path / "t.jsonl", tmp_path / "t.har"
    assert export(db, jsonl, "jsonl") == len(turns)
    assert export(db, har, "har") == len(turns)
    return db_bytes, jsonl.read_bytes(), har.read_bytes()


@pytest.mark.parametrize("name, text, secret", FORMATS, ids=[f[0] for f in FORMATS])
def test_each_format_is_redacted_in_the_database_jsonl_and_har(tmp_path, name, text, secret):
    assert secret in text
    out = Redactor().text(text)
    assert secret not in out and REDACTED in out, out
    # As the client's raw JSON spells it, too (escaped quotes and newlines).
    assert secret not in Redactor().text(json.dumps({"content": text}))
    db, jsonl, har = _record_and_export(tmp_path, [_turn(0, text)])
    for where, data in (("db", db), ("jsonl", jsonl), ("har", har)):
        assert secret.encode() not in data, where
    assert REDACTED.encode() in jsonl


def test_a_credential_header_is_dropped_everywhere(tmp_path):
    headers = {"X-Credential": "XCredHeaderS3cret77", "X-Client-Credentials": "XCredHeaderS3cret78",
               "Content-Type": "application/json"}
    assert Redactor().headers(headers) == {"Content-Type": "application/json"}
    db, jsonl, har = _record_and_export(tmp_path, [_turn(0, "hi", headers)])
    for data in (db, jsonl, har):
        assert b"XCredHeaderS3cret7" not in data


@pytest.mark.parametrize("name", CREDENTIAL_HEADERS)
def test_each_credential_header_name_is_dropped_everywhere(tmp_path, name):
    headers = {name: "HdrCredS3cretValue77", "Idempotency-Key": "retry-1", "Content-Type": "application/json"}
    assert Redactor().headers(headers) == {"Idempotency-Key": "retry-1", "Content-Type": "application/json"}
    db, jsonl, har = _record_and_export(tmp_path, [_turn(0, "hi", headers)])
    for data in (db, jsonl, har):
        assert b"HdrCredS3cretValue77" not in data


def test_credentials_inside_structured_json_are_redacted(tmp_path):
    """An Anthropic tool_use input is a JSON object, not text: a credential header or Docker's
    `auth` in it has its key and value apart, where no text pattern sees them together."""
    body = {"model": "m", "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "http", "input": {
            "headers": {"Authorization": "Basic U3RydWN0VXNlcjpTdHJ1Y3RQdzc3", "X-Credential": "StructCredS3cret77"},
            "docker": {"auths": {"r.example.com": {"auth": "RG9ja2VyU3RydWN0UHc3Nw=="}}}}}]},
        {"role": "user", "content": "ok"}]}
    turn = Turn(request_id="r", started_at=1.0, endpoint="/v1/messages", upstream="u", request_body=body,
                request_raw=json.dumps(body))
    db, jsonl, har = _record_and_export(tmp_path, [turn])
    for data in (db, jsonl, har):
        for secret in (b"U3RydWN0VXNlcjpTdHJ1Y3RQdzc3", b"StructCredS3cret77", b"RG9ja2VyU3RydWN0UHc3Nw"):
            assert secret not in data


@pytest.mark.parametrize("token", [
    "sk-proj-AbCdEfGhIjKlMnOpQrSt0123", "ghp_" + "a1B2" * 9, "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    "gsk_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789AbCdEfGhIjKlMnOp", "AKIAABCDEFGHIJKLMNOP", "dapi0123456789abcdef0123456789abcdef"])
def test_a_token_at_the_start_of_a_line_is_redacted_in_the_raw_json_too(token):
    """In a raw body a token opening a line (or after a tab) follows the escape `\\n`, whose `n` is a
    word character: the prefix's word-boundary check must not take it for part of a word."""
    for sep in ("\n", "\t", "\r\n"):
        raw = json.dumps({"content": f"line one{sep}{token} and more"})
        assert token not in Redactor().text(raw), (sep, raw)


@pytest.mark.parametrize("text", NEGATIVES)
def test_ordinary_code_and_prose_is_left_alone(text):
    assert Redactor().text(text) == text


def test_every_format_through_a_real_proxy(engine_server, tmp_path):
    """One request carrying every format (and the header), through the proxy on 127.0.0.1."""
    url, rec = engine_server
    text = "\n".join(t for _, t, _ in FORMATS)
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   headers={"X-Credential": "XCredHeaderS3cret79", "X-Session-Id": "s"},
                   json={"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": text}]})
    assert r.status_code == 200, r.text
    assert rec.flush(30)
    files = [p for p in rec.path.parent.iterdir() if p.name.startswith(rec.path.name)]
    jsonl, har = tmp_path / "e.jsonl", tmp_path / "e.har"
    export(rec.path, jsonl, "jsonl")
    export(rec.path, har, "har")
    data = _all_bytes([*files, jsonl, har])
    for name, _, secret in FORMATS:
        assert secret.encode() not in data, name
    assert b"XCredHeaderS3cret79" not in data


def test_redaction_stays_linear_on_the_new_formats_near_misses():
    """The redaction bench's adversarial bodies (testsupport/redact_bodies.py), the new formats' near
    misses among them, at 64 KB."""
    from testsupport.redact_bodies import ADVERSARIAL_UNITS, MAX_RATIO, adversarial_body, ordinary_body
    from tests.test_redact import _best

    new_units = {k: v for k, v in ADVERSARIAL_UNITS.items()
                 if k in ("url_userinfo_no_at", "url_colon_chain", "sig_near_misses", "sendgrid_one_dot",
                          "discord_dots", "digit_colons", "telegram_near_misses", "docker_auth_runs",
                          "basic_after_header", "netrc_login_runs", "bearer_lower_spaces",
                          "whsec_short", "gitlab_dash_runs", "key_dash_hex_short", "dapi_short", "aaaa_runs",
                          "fcm_no_tail", "atlasv1_short", "dsn_hex_no_at", "discord_hook_short", "age_short")}
    assert len(new_units) == 21
    r = Redactor()
    size = 64_000
    ordinary = _best(r.text, ordinary_body(size))
    slow = {name: round(_best(r.text, adversarial_body(unit, size)) / ordinary, 1) for name, unit in new_units.items()}
    assert max(slow.values()) <= 4 * MAX_RATIO, slow

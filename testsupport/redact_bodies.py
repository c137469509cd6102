"""Bodies for the redactor's linear-time bound: an ordinary request body and bodies built to defeat each
default pattern of recorder/redact.py, of a given size. bench/bench_redact.py times them at 1 MB against
`MAX_RATIO`; tests/test_redact.py and tests/test_redact_formats.py at 64 KB against a multiple of it."""

from __future__ import annotations

import json

from testsupport.synthetic_log import generate_records

# Every adversarial body costs at most this many times the ordinary body of the same size, at 1 MB
# (docs/PERFORMANCE.md); a pattern that rescans from each start is thousands of times it.
MAX_RATIO = 25.0

# Each repeats a unit that starts a match attempt and then fails (or matches) as
# late as it can, so a pattern that rescans from each start shows up quadratic.
ADVERSARIAL_UNITS = {
    "pem_unterminated_headers": "-----BEGIN PRIVATE KEY-----\n",
    "pem_header_no_key": "-----BEGIN RSA AAAAAAAAAAAAAAAAAAAAAA ",
    "pem_body_no_footer": "-----BEGIN PRIVATE KEY-----\n" + "MIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n" * 2000,
    "jwt_dash_runs": "eyJ-",
    "jwt_two_parts": "eyJhbGciOiJIUzI1.eyJ-",
    "sk_near_misses": "sk-abcdefghijklmno ",
    "sk_dash_chain": "sk-",
    "bearer_spaces": "Bearer " + " " * 40,
    "aws_near_misses": "AKIAABCDEFGHIJKLMNO ",
    "password_no_value": "password:  \t ",
    "password_chain": "DB_PASSWORD=",
    "secret_name_prefix_runs": "a-",
    "base64_run": "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo",
    "ghp_near_misses": "ghp_" + "a" * 35 + " ",
    "unicode_text": "日本語のテキスト sk-é ",
    "json_escaped_key": '\\"password\\": \\"',
    # issue 25's formats
    "url_userinfo_no_at": "://user:" + "p" * 30,
    "url_colon_chain": "://a:",
    "sig_near_misses": "sig=" + "A" * 15 + " ",
    "sendgrid_one_dot": "SG." + "a" * 40 + " ",
    "discord_dots": "M" + "a" * 23 + ".",
    "digit_colons": "12345678:",
    "telegram_near_misses": "12345678:" + "A" * 34 + " ",
    "docker_auth_runs": '"auth": "',
    "basic_after_header": "authorization: basic ",
    "netrc_login_runs": "login bob\n",
    "bearer_lower_spaces": "bearer " + " " * 40,
    # Near misses of the vendor-prefixed formats: each prefix with one character too few after it.
    "whsec_short": "whsec_" + "a" * 23 + " ",
    "gitlab_dash_runs": "glrt-" + "-" * 19 + " ",
    "key_dash_hex_short": "key-" + "a" * 31 + " ",
    "dapi_short": "dapi" + "0" * 31 + " ",
    "aaaa_runs": "AAAA",
    "fcm_no_tail": "AAAAbcdefgh:APA91b" + "x" * 99 + " ",
    "atlasv1_short": "abcdefghijklmn.atlasv1." + "x" * 59 + " ",
    "dsn_hex_no_at": "://" + "a" * 32 + ":",
    "discord_hook_short": "discord.com/api/webhooks/123456/" + "x" * 19 + " ",
    "age_short": "AGE-SECRET-KEY-1" + "Q" * 57 + " ",
}


def ordinary_body(size: int) -> str:
    """Real-looking request JSON (system prompt, tools, code, tool output), `size` characters."""
    text = ""
    for record in generate_records(n_requests=40, n_sessions=2, seed=0):
        text += json.dumps(record["request"], ensure_ascii=False)
        if len(text) >= size:
            break
    while len(text) < size:
        text += text
    return text[:size]


def adversarial_body(unit: str, size: int) -> str:
    return (unit * (size // len(unit) + 1))[:size]

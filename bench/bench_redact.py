"""Redaction cost on ordinary and adversarial bodies: it must stay linear.

Issue 14 (finding 4): 218 KB of unterminated `-----BEGIN PRIVATE KEY-----` lines
took the old PEM pattern ~77 s, on the writer thread, stalling every response.
This times `Redactor.text` on a 1 MB slice of an ordinary request body (from
the synthetic field log) and on 1 MB bodies built to defeat each default
pattern, then reports each adversarial time as a multiple of the ordinary one,
and the cost of quadrupling the size (1 MB vs 0.25 MB; linear ~4, quadratic ~16).
Side by side, the redactor of 7e6ea90 (`LEGACY_PATTERNS`, its one combined pass)
on the same ordinary body, and on the unterminated PEM headers at 1/50 of the
size (the full size would take minutes).

Bound (docs/PERFORMANCE.md): every adversarial body <= 25x the ordinary body of
the same size; exit status 1 when one exceeds it. (A pattern that rescans from
each start is thousands of times the ordinary body at 1 MB. The quadrupling
figure is reported only: for bodies of a few ms it is mostly cache effects.)

    python bench/bench_redact.py            # 1 MB bodies
    python bench/bench_redact.py --mb 0.25  # quicker
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.synthetic_log import generate_records  # noqa: E402
from recorder.redact import Redactor  # noqa: E402

MAX_RATIO = 25.0

# recorder/redact.py's patterns at 7e6ea90, for the side-by-side.
LEGACY_PATTERNS = (
    r"\bsk-[A-Za-z0-9_\-]{16,}",
    r"\bBearer\s+[A-Za-z0-9._~+/\-]{16,}=*",
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    r"\bgh[pousr]_[A-Za-z0-9]{36,}",
    r"\bgithub_pat_[A-Za-z0-9_]{22,}",
    r"\bxox[abprs]-[A-Za-z0-9\-]{10,}",
    r"\bAIza[0-9A-Za-z_\-]{35}",
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----",
)


class LegacyRedactor:
    """7e6ea90's `Redactor.text`: the `\\b` patterns in one alternation, the PEM one alone."""

    def __init__(self):
        anchored = [p for p in LEGACY_PATTERNS if p.startswith("\\b")]
        self.passes = [re.compile("|".join(f"(?:{p})" for p in anchored)),
                       *(re.compile(p) for p in LEGACY_PATTERNS if p not in anchored)]

    def text(self, value: str) -> str:
        for pattern in self.passes:
            value = pattern.sub("[REDACTED]", value)
        return value

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


def best_time(redactor, text: str, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        redactor.text(text)
        best = min(best, time.perf_counter() - t0)
    return best


def run(size: int, legacy: bool = True) -> dict:
    redactor = Redactor()
    ordinary = best_time(redactor, ordinary_body(size))
    quarter_ordinary = best_time(redactor, ordinary_body(size // 4))
    rows = {}
    for name, unit in ADVERSARIAL_UNITS.items():
        full = best_time(redactor, adversarial_body(unit, size))
        quarter = best_time(redactor, adversarial_body(unit, size // 4))
        rows[name] = {"ms": round(full * 1000, 2), "x_ordinary": round(full / ordinary, 2),
                      "quadrupling": round(full / max(quarter, 1e-9), 2)}
    worst_ratio = max(r["x_ordinary"] for r in rows.values())
    worst_quadrupling = max(r["quadrupling"] for r in rows.values())
    result = {
        "bytes": size,
        "ordinary_ms": round(ordinary * 1000, 2),
        "ordinary_quadrupling": round(ordinary / max(quarter_ordinary, 1e-9), 2),
        "adversarial": rows,
        "worst_x_ordinary": worst_ratio,
        "worst_quadrupling": worst_quadrupling,
        "bound_x_ordinary": MAX_RATIO,
        "within_bounds": worst_ratio <= MAX_RATIO,
    }
    if legacy:
        old = LegacyRedactor()
        small = size // 50
        pem = ADVERSARIAL_UNITS["pem_unterminated_headers"]
        result["legacy"] = {
            "ordinary_ms": round(best_time(old, ordinary_body(size)) * 1000, 2),
            "pem_unterminated_bytes": small,
            "pem_unterminated_ms": round(best_time(old, adversarial_body(pem, small), repeats=1) * 1000, 1),
            "new_pem_unterminated_ms_same_bytes": round(best_time(redactor, adversarial_body(pem, small)) * 1000, 2),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=1.0, help="size of each body in MB")
    args = ap.parse_args()
    result = run(int(args.mb * 1_000_000))
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["within_bounds"] else 1)


if __name__ == "__main__":
    main()

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

from recorder.redact import Redactor  # noqa: E402
from testsupport.redact_bodies import ADVERSARIAL_UNITS, MAX_RATIO, adversarial_body, ordinary_body  # noqa: E402

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

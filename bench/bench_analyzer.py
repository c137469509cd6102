"""Analyzer speed (issue 3): the synthetic field-report-shaped recording,
analysed end to end at the rendered level with tiktoken o200k_base, against
the naive method (parse every line in full, render every request in full,
tokenise every rendering in full, compare token lists) in the same run.

    python bench/bench_analyzer.py [--requests 1260] [--template fixtures/templates/qwen35_merge_system.jinja]

Prints one JSON object: sizes, seconds for both methods, the speed-up, peak
memory (ru_maxrss, whole process) and how far the fast token counts are from
the naive ones. Run it under `taskset -c 0,1` to hold it to 2 cores.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analyzer import analyze  # noqa: E402
from analyzer.divergence import common_prefix_len  # noqa: E402
from analyzer.render import make_renderer  # noqa: E402
from analyzer.tokens import default_tokenizer  # noqa: E402
from testsupport.synthetic_log import write_jsonl  # noqa: E402

DEFAULT_TEMPLATE = ROOT / "fixtures" / "templates" / "qwen35_merge_system.jinja"


def naive(path: Path, template: Path) -> dict[tuple[str, int], tuple[int, int]]:
    """(session, turn) -> (prompt tokens, common prefix tokens), the slow, obvious way."""
    renderer, tok = make_renderer(template), default_tokenizer()
    prev: dict[str, list[int]] = {}
    index: dict[str, int] = {}
    out = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            ids = tok(renderer.render(rec["request"]).text)
            s = rec["session"]
            common = common_prefix_len(prev[s], ids) if s in prev else 0
            out[(s, index.get(s, 0))] = (len(ids), common)
            index[s] = index.get(s, 0) + 1
            prev[s] = ids
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1260)
    ap.add_argument("--template", type=Path, default=DEFAULT_TEMPLATE)
    ap.add_argument("--keep", type=Path, help="write the synthetic log here and keep it")
    ap.add_argument("--skip-naive", action="store_true")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = write_jsonl(args.keep or Path(tmp) / "synthetic.jsonl", n_requests=args.requests)
        # One-time costs outside both timings: the BPE file, and the imports the
        # fast path happens to pay first (the naive run would otherwise get them free).
        default_tokenizer()
        import deepdiff  # noqa: F401
        import jinja2.sandbox  # noqa: F401
        import multiprocessing.pool  # noqa: F401
        t0 = time.perf_counter()
        report = analyze(path, template=args.template)
        fast_s = time.perf_counter() - t0
        fast_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        prompts = sorted(t.prompt_tokens for s in report.sessions for t in s.turns if t.prompt_tokens)
        result = {
            "requests": sum(len(s.turns) for s in report.sessions),
            "sessions": len(report.sessions),
            "file_mb": round(path.stat().st_size / 1e6, 1),
            "median_prompt_tokens": int(statistics.median(prompts)),
            "p90_prompt_tokens": prompts[int(len(prompts) * 0.9)],
            "breaks_by_cause": {c: v["breaks"] for c, v in report.to_dict()["totals"]["by_cause"].items()},
            "fast_s": round(fast_s, 2),
            "peak_rss_mb_after_fast": round(fast_rss),
            "peak_rss_mb_fast_workers": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
        }
        if not args.skip_naive:
            t0 = time.perf_counter()
            slow = naive(path, args.template)
            naive_s = time.perf_counter() - t0
            diffs, rel, breaks_same = [], [], 0
            for s in report.sessions:
                for t in s.turns:
                    p, c = slow[(s.id, t.index)]
                    diffs.append(max(abs(p - t.prompt_tokens), abs(c - t.common_prefix_tokens)))
                    rel.append(abs(p - t.prompt_tokens) / max(1, p))
                    # Same verdict: the naive method sees a break exactly where the fast one names one.
                    breaks_same += (t.brk is not None) == (t.index > 0 and c < slow[(s.id, t.index - 1)][0])
            result |= {
                "naive_s": round(naive_s, 2),
                "speedup": round(naive_s / fast_s, 1),
                "max_token_count_difference": max(diffs),
                "max_relative_prompt_difference": round(max(rel), 5),
                "turns_with_same_break_verdict": breaks_same,
                "turns_with_exact_counts": sum(d == 0 for d in diffs),
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""Real session files read as a user would: per file, the calls it holds, the turns rebuilt, the calls
left out, and the breaks the analyzer finds beside the breaks the file's own usage shows (a call that
read from cache less than half of the previous call's prompt, by the provider's count).

    python bench/real_transcripts.py [FILE ...]   (default: fixtures/transcripts/*/real/*.jsonl)
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from analyzer import analyze  # noqa: E402
from recorder.transcripts import read_transcripts  # noqa: E402


def usage_breaks(turns) -> int:
    """Calls whose cached tokens (provider's count) are under half the previous call's prompt (calls
    the provider counted no prompt for, failed or aborted ones, are passed over)."""
    n, prev = 0, None
    for t in turns:
        if prev is not None and t.prompt_tokens and t.cached_tokens is not None and prev.prompt_tokens and \
                t.cached_tokens < prev.prompt_tokens / 2:
            n += 1
        if t.prompt_tokens:
            prev = t
    return n


def main(files: list[str]) -> None:
    print(f"{'file':44} {'harness / version':28} {'calls':>5} {'rebuilt':>7} {'left out':>8} "
          f"{'usage breaks':>12} {'analyzer breaks':>15}  causes")
    for f in files:
        try:
            transcripts = read_transcripts(f)
        except Exception as exc:  # a file refused: its one line is the measurement
            print(f"{Path(f).name[:44]:44} refused: {exc}")
            continue
        turns = [turn for t in transcripts for turn in t.turns]
        report = analyze(turns) if turns else None
        causes = Counter(tr.brk.cause for s in (report.sessions if report else []) for tr in s.turns if tr.brk)
        versions = ", ".join(sorted({f"{t.harness} {t.version}" for t in transcripts}))
        print(f"{Path(f).name[:44]:44} {versions[:28]:28} {sum(t.calls for t in transcripts):5} {len(turns):7} "
              f"{sum(t.left_out for t in transcripts):8} {sum(usage_breaks(t.turns) for t in transcripts):12} "
              f"{sum(causes.values()):15}  {dict(causes)}")


if __name__ == "__main__":
    main(sys.argv[1:] or sorted(str(p) for p in ROOT.glob("fixtures/transcripts/*/real/*.jsonl")))

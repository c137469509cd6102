"""`--fix volatile` measured: a session whose system prompt carries a per-turn timestamp, served by the
embedded engine without and with the fix, side by side (docs/FIXES.md "Measured").

    python bench/fix_volatile_share.py                 # the tiny fixture model (seconds)
    python bench/fix_volatile_share.py --model default # the bundled SmolLM2 (minutes on 2 cores)

Prints the cached share of turns 2 and later for each, and each turn's prompt and cached tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from analyzer.fixes.sessions import FixSessions  # noqa: E402
from engine.engine import Engine  # noqa: E402
from proxy.app import create_app  # noqa: E402
from proxy.engine_backend import EngineBackend  # noqa: E402
from recorder.store import Recorder  # noqa: E402
from testsupport.servers import TINY_MODEL, running_server  # noqa: E402
from testsupport.volatile_session import cached_share, play  # noqa: E402


def measure(model: Path, fixes: list[str], turns: int) -> dict:
    engine = Engine(model, name=model.name).start()
    engine.wait_ready(600)
    try:
        with tempfile.TemporaryDirectory() as tmp, Recorder(Path(tmp) / "a.db") as rec:
            with running_server(create_app(EngineBackend(engine), rec,
                                           fixes=FixSessions(fixes) if fixes else None)) as url:
                usages = play(url, turns=turns)
    finally:
        engine.shutdown()
    return {"fixes": fixes, "cached_share_turns_2_plus": round(cached_share(usages), 4),
            "turns": [(u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens")) for u in usages]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(TINY_MODEL), help="a model directory, or 'default' for the bundled one")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.model == "default":
        from engine.default_model import default_model_dir

        model = default_model_dir()
    else:
        model = Path(args.model)
    rows = [measure(model, [], args.turns), measure(model, ["volatile"], args.turns)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"model {model.name}, {args.turns} turns, cached share of turns 2+ (prompt, cached per turn):")
    for row in rows:
        name = "--fix volatile" if row["fixes"] else "as sent"
        print(f"  {name:15} {row['cached_share_turns_2_plus'] * 100:5.1f} %   {row['turns']}")


if __name__ == "__main__":
    main()

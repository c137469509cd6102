"""The docs name files that exist: a path like `proxy/relay.py` or `bench/soak_abandon.py` in README.md,
docs/*.md or bench/README.md is a file in the repository.

Docs that describe code that is not there were one of the findings behind the project's layout work;
a module moved or retired without its mentions fails here. docs/history/ is a notebook of what was
(not checked). Two kinds of mention are not claims about this repository: the pytest plugin's example
names files of the user's own project, and a benchmark marked retired lives in git history."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("analyzer", "engine", "proxy", "recorder", "prefixtrace", "common", "wire", "bench", "tests",
        "testsupport", "fixtures", "docs")
PATH = re.compile(r"(?<![\w/.-])((?:%s)/[\w/.-]*?\w\.(?:py|md|sh|cu|cuh|jsonl|json|jinja|toml))(?![\w])" % "|".join(TOPS))
USERS_OWN = {"tests/test_prompt_stability.py", "tests/qwen3.jinja"}  # docs/ANALYZER.md's plugin example


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def mentions() -> list[tuple[str, str, int]]:
    found = []
    for doc in documents():
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if "retired" in line:
                continue
            for match in PATH.finditer(line):
                found.append((match.group(1), str(doc.relative_to(ROOT)), number))
    return found


def test_the_scan_finds_the_paths_the_docs_name():
    named = {path for path, _, _ in mentions()}
    assert {"proxy/relay.py", "engine/scheduler.py", "tests/test_package_graph.py", "prefixtrace/wire/sse.py"} <= named


def test_every_file_the_docs_name_exists():
    missing = [f"{doc}:{line} names {path}" for path, doc, line in mentions()
               if path not in USERS_OWN and not (ROOT / path).exists()]
    assert missing == []

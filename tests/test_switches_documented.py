"""Every PREFIXTRACE_* environment variable the product reads is documented in docs/CONFIG.md.

The issue behind it: engine switches that only an environment variable reached, known to nobody but
the code. A variable named in product code (analyzer, engine, prefixtrace, proxy, recorder) and not in
the configuration page fails here, so a new switch cannot land undocumented."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("analyzer", "engine", "prefixtrace", "proxy", "recorder")
NAME = re.compile(r"\bPREFIXTRACE_[A-Z0-9_]*[A-Z0-9]\b")


def named_in_product() -> dict[str, str]:
    names = {}
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else []:
            for name in NAME.findall(path.read_text()):
                names.setdefault(name, str(path.relative_to(ROOT)))
    return names


def test_the_product_names_its_variables():
    # guards the scan itself: an empty result would pass the test below vacuously
    assert {"PREFIXTRACE_DECODE_ATTENTION", "PREFIXTRACE_CACHE_DIR", "PREFIXTRACE_DISK_HOST_COPY"} <= set(named_in_product())


def test_every_variable_the_product_reads_is_in_config_md():
    documented = set(NAME.findall((ROOT / "docs" / "CONFIG.md").read_text()))
    missing = {name: where for name, where in named_in_product().items() if name not in documented}
    assert missing == {}, f"document these in docs/CONFIG.md: {missing}"

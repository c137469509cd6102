"""engine/kernels/ is a room of its own (docs/ARCHITECTURE.md, "The kernels"): the engine core reaches it
only through `engine.kernels.selector`, its modules import each other without a cycle and each imports
alone, no kernel is configured by a module-level setter, its CUDA sources are package data, and the CPU
gets the table that takes nothing."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "engine" / "kernels"
MODULES = sorted(p.stem for p in KERNELS.glob("*.py") if p.stem != "__init__")
# The core modules allowed to hold the seam: the caches' encode and attention, the model hook, the load.
SEAM_USERS = {"engine/tq_cache.py", "engine/tq_buffers.py", "engine/attention_hook.py", "engine/engine.py"}


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def kernel_imports(module: str) -> set[str]:
    """The engine.kernels modules `module` imports (engine.kernels.X or `from engine.kernels import X`)."""
    out = set()
    for name in imports(KERNELS / f"{module}.py"):
        parts = name.split(".")
        if parts[:2] == ["engine", "kernels"] and len(parts) > 2 and parts[2] in MODULES:
            out.add(parts[2])
    return out - {module}


def test_the_engine_core_reaches_the_kernels_only_through_the_selector():
    found = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel.startswith("engine/kernels/"):
            continue
        for name in imports(path):
            if name.startswith("engine.kernels") and name != "engine.kernels":
                if name != "engine.kernels.selector" or rel not in SEAM_USERS:
                    found.append(f"{rel} imports {name}")
    # testsupport/tq_quality.py (a measuring aid, not the serving path) imports no kernel either
    assert found == []


def test_the_kernel_modules_import_each_other_without_a_cycle():
    graph = {m: kernel_imports(m) for m in MODULES}
    done, path = set(), []

    def visit(m):
        assert m not in path, "cycle: " + " -> ".join(path + [m])
        if m in done:
            return
        path.append(m)
        for n in graph[m]:
            visit(n)
        path.pop()
        done.add(m)

    for m in MODULES:
        visit(m)
    assert graph["common"] == set() and "selector" not in set().union(*graph.values())


@pytest.mark.parametrize("module", MODULES)
def test_each_kernel_module_imports_alone(module):
    """In a fresh interpreter, importing one module works (no lazy import dodging a cycle is needed)."""
    run = subprocess.run([sys.executable, "-c", f"import engine.kernels.{module}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_no_kernel_is_configured_by_a_module_level_setter_and_no_module_is_over_600_lines():
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        setters = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("set_")]
        assert setters == [], (path.name, setters)
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], path.name  # no state a setter swaps
        assert len(path.read_text().splitlines()) <= 600, path.name


def test_every_kernel_source_is_package_data_and_every_all_name_exists():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["engine"]
    sources = sorted(p.name for p in (KERNELS / "cuda").iterdir())
    assert sources and all(any(Path("kernels/cuda", s).match(p) for p in patterns) for s in sources)
    import importlib

    for m in MODULES:
        module = importlib.import_module(f"engine.kernels.{m}")
        missing = [n for n in getattr(module, "__all__", []) if not hasattr(module, n)]
        assert missing == [], (m, missing)


def test_the_cpu_gets_the_table_that_takes_nothing():
    from engine.kernels import common, selector

    assert not common.available()
    kernels = selector.select()
    assert type(kernels) is selector.DecodeKernels and not kernels.cuda and not kernels.defer_encode
    assert kernels.encode(None, None, None) is None and kernels.tq_attend(*[None] * 11) is None
    assert kernels.dense_attend(None, None, None, None, 1.0, None) is None
    assert kernels.prebuild_tq(None, None, 1) == {} and kernels.prebuild_dense(None, 1) == {}
    assert kernels.install_projections(None) == 0
    assert type(selector.for_setting("all")) is selector.DecodeKernels  # no CUDA: the setting cannot add kernels

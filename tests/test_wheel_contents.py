"""What the wheel installs: no test tooling (nothing in it imports unittest, pytest or testsupport/), and
exactly the top-level import names docs/ARCHITECTURE.md decides (a user's site-packages gets these names,
and a generic one can shadow another distribution's).

The wheel is built from a copy of the sources, so the repository gets no build/ or egg-info. Where the
interpreter can pack a wheel (the `wheel` package, or setuptools >= 70.1 which bundles bdist_wheel) it is
built with pip, offline; otherwise setuptools' build_py lays out the same files (bdist_wheel packs exactly
build_py's output for a pure-Python project like this one).
"""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parent.parent

# Today's installed names; docs/ARCHITECTURE.md ("One name in site-packages") says where this is going.
TOP_LEVEL = {"analyzer", "engine", "prefixtrace", "proxy", "recorder"}
TEST_TOOLING = {"unittest", "pytest", "testsupport"}
# The pytest plugin is a product feature (pyproject's pytest11 entry point: the `assert_prefix_stable`
# fixture for a harness's own suite); only pytest loads it, so it may import pytest and nothing else may.
PYTEST_PLUGIN = "analyzer/pytest_plugin.py"


def _can_pack_wheels() -> bool:
    major_minor = tuple(int(p) for p in setuptools.__version__.split(".")[:2])
    return importlib.util.find_spec("wheel") is not None or major_minor >= (70, 1)


def built_files(tmp: Path) -> dict[str, bytes]:
    """{path inside the wheel: content} for every file of the built wheel but its .dist-info."""
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "tests", "bench", "fixtures", "docs", "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    if _can_pack_wheels():
        out = tmp / "wheel"
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-q", "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
        (wheel,) = out.glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            return {n: z.read(n) for n in z.namelist() if ".dist-info/" not in n and not n.endswith("/")}
    lib = tmp / "lib"
    subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py", "-d", str(lib)],
                   cwd=src, check=True, capture_output=True, timeout=300)
    return {str(p.relative_to(lib)): p.read_bytes() for p in lib.rglob("*") if p.is_file()}


def imported_roots(source: bytes) -> set[str]:
    """The top-level names a module imports anywhere (a lazy import inside a function included)."""
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> dict[str, bytes]:
    return built_files(tmp_path_factory.mktemp("wheel"))


@pytest.mark.slow
def test_no_module_in_the_wheel_imports_test_tooling(wheel_files):
    modules = {name: body for name, body in wheel_files.items() if name.endswith(".py")}
    assert len(modules) > 100, sorted(modules)  # the packages were found at all
    found = {name: sorted(imported_roots(body) & TEST_TOOLING) for name, body in modules.items()}
    found = {name: roots for name, roots in found.items() if roots and not (name == PYTEST_PLUGIN and roots == ["pytest"])}
    assert found == {}
    assert not any(name.startswith("testsupport/") for name in wheel_files)


@pytest.mark.slow
def test_the_wheel_installs_exactly_the_decided_top_level_names(wheel_files):
    assert {name.split("/")[0] for name in wheel_files} == TOP_LEVEL
    # the kernels' CUDA sources ride along as package data
    assert any(name.startswith("engine/kernels/cuda/") and name.endswith(".cu") for name in wheel_files)

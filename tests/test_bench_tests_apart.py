"""bench/ and tests/ do not import each other: what both need lives in the product or in testsupport/,
and the product imports neither of the three (bench/README.md, testsupport/__init__.py). And
bench/README.md's tables list every script in bench/ and none that is gone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("prefixtrace", "proxy", "engine", "analyzer", "recorder")
# A script or test may also load a module by name or by path instead of `import`.
LOADERS = {"import_module", "run_module", "run_path", "spec_from_file_location", "SourceFileLoader", "__import__"}


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each module `path` imports, `import` / `from` statements and loader calls alike
    (a loader's string arguments, a path's folder names as dotted names)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in LOADERS:
                for arg in ast.walk(node):
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        found.append((node.lineno, arg.value.replace("/", ".").removeprefix("./")))
    return found


def crossings(folders: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, name in imports(path):
                if name.split(".")[0] in forbidden:
                    out.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return out


def test_bench_imports_nothing_from_tests():
    assert crossings(("bench",), ("tests", "conftest")) == []


def test_tests_import_nothing_from_bench():
    assert crossings(("tests",), ("bench",)) == []


def test_testsupport_imports_neither_tests_nor_bench():
    assert crossings(("testsupport",), ("tests", "conftest", "bench")) == []


@pytest.mark.parametrize("package", PRODUCT)
def test_the_product_imports_none_of_them(package):
    assert crossings((package,), ("tests", "conftest", "bench", "testsupport")) == []


def test_the_check_sees_each_kind_of_import(tmp_path):
    source = ("import bench.soak_recorder\nfrom bench import bench_redact\nimport importlib\n"
              "importlib.import_module('bench.synthetic_log')\nrunpy.run_path('bench/soak_recorder.py')\n")
    (tmp_path / "t.py").write_text(source)
    names = [name for _, name in imports(tmp_path / "t.py")]
    assert [n.split(".")[0] for n in names if n.startswith("bench")] == ["bench"] * 4


def test_the_bench_readme_lists_every_script_and_no_absent_one():
    readme = (ROOT / "bench" / "README.md").read_text()
    scripts = {p.name for p in (ROOT / "bench").glob("*.py")}
    assert sorted(s for s in scripts if f"`{s}`" not in readme) == []
    listed = set(re.findall(r"^\| `([\w.]+\.py)` \|", readme, re.MULTILINE))
    assert sorted(listed - scripts) == []

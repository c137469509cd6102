"""The package graph of docs/ARCHITECTURE.md: nothing below the CLI imports the server, and the wire
model imports neither the server, the engine nor FastAPI (the recorder and analyzer use it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imported_modules(path):
            if name.split(".")[0] in forbidden or name in forbidden:
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize("folder", ["recorder", "analyzer", "engine", "wire"])
def test_no_package_below_the_cli_imports_the_server(folder):
    assert offenders(folder, ("proxy",)) == []


def test_the_wire_model_imports_neither_the_engine_nor_fastapi():
    assert offenders("wire", ("engine", "fastapi", "starlette", "mlx", "mlx_lm")) == []

"""The package graph of docs/ARCHITECTURE.md ("Package graph"), checked against the code.

The doc's layer table is the source: every import between product packages (at module level or inside
a function: the whole file is walked, so a lazy import cannot dodge anything) goes to the same layer
or a lower one, the graph has no cycle, each row's `imports` column is what that package does import,
and every product package has a row. Beside it: the floor imports nothing of the product's third-party
stack, no package outside the engine imports MLX, and `prefixtrace serve --upstream` never loads MLX.
"""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# testsupport/: helpers the tests and the benchmarks share, not shipped (tests/test_bench_tests_apart.py
# checks that no product package imports it)
NOT_PRODUCT = {"tests", "bench", "fixtures", "docs", "testsupport"}


def layer_table(doc: str | None = None) -> dict[str, tuple[int, set[str]]]:
    """{package (dotted): (layer, the packages its row says it imports)} from the first table under
    "### Package graph"."""
    section = (DOC.read_text() if doc is None else doc).split("### Package graph", 1)[1]
    rows: dict[str, tuple[int, set[str]]] = {}
    for line in section.splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not cells[0].isdigit():
            continue  # the header and its rule
        package = cells[1].strip("`").rstrip("/").replace("/", ".")
        imports = {name.rstrip("/").replace("/", ".") for name in re.findall(r"`([^`]+)`", cells[2])}
        assert package not in rows, f"{package} has two rows"
        rows[package] = (int(cells[0]), imports)
    assert rows, "docs/ARCHITECTURE.md has no layer table under '### Package graph'"
    return rows


def product_packages() -> set[str]:
    return {p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name not in NOT_PRODUCT}


def node_of(module: str, nodes: set[str]) -> str | None:
    """The table's package a dotted module belongs to (the longest row that prefixes it)."""
    best = None
    for node in nodes:
        if (module == node or module.startswith(node + ".")) and (best is None or len(node) > len(best)):
            best = node
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, package: list[str] | None = None) -> list[tuple[str, int]]:
    """(dotted module, line) of every import in the file, function bodies included; `from X import Y`
    gives X.Y (a submodule or a name in X: either way X's package), relative imports resolved against
    `package` (by default the file's own)."""
    if package is None:
        package = module_name(path).split(".")
        if path.name != "__init__.py":
            package = package[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return found


def package_edges(nodes: set[str]) -> dict[tuple[str, str], list[str]]:
    """{(importer, imported): ["file:line imports module", ...]} between different table packages."""
    edges: dict[tuple[str, str], list[str]] = {}
    for package in product_packages():
        for path in sorted((ROOT / package).rglob("*.py")):
            source = node_of(module_name(path), nodes)
            for module, line in imports_of(path):
                target = node_of(module, nodes)
                if target is not None and target != source:
                    edges.setdefault((source, target), []).append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return edges


def test_every_product_package_has_a_row_and_a_place_in_pyproject():
    table = layer_table()
    tops = {name.split(".")[0] for name in table}
    assert product_packages() - tops == set(), "a package without a row in docs/ARCHITECTURE.md's layer table"
    assert tops - product_packages() == set(), "a row for a package that does not exist"
    for name in table:
        assert (ROOT / name.replace(".", "/") / "__init__.py").exists(), f"{name}: no such package"
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert {f"{name}*" for name in tops} <= set(include), "a package pyproject.toml does not install"


def test_every_import_goes_to_the_same_layer_or_below():
    table = layer_table()
    upward = [f"{where} (layer {table[a][0]} -> {table[b][0]})"
              for (a, b), found in sorted(package_edges(set(table)).items()) if table[b][0] > table[a][0]
              for where in found]
    assert upward == []


def test_the_package_graph_has_no_cycle():
    table = layer_table()
    edges = package_edges(set(table))
    graph: dict[str, set[str]] = {name: set() for name in table}
    for a, b in edges:
        graph[a].add(b)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state and (found := cycle_from(nxt, path + [node])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := cycle_from(node, [])):
            pytest.fail(" -> ".join(found) + "\n" + "\n".join(
                where for a, b in zip(found, found[1:]) for where in edges[(a, b)][:3]))


def test_each_rows_imports_column_is_what_the_package_imports():
    table = layer_table()
    actual: dict[str, set[str]] = {name: set() for name in table}
    for a, b in package_edges(set(table)):
        actual[a].add(b)
    assert {name: sorted(actual[name]) for name in table} == {name: sorted(table[name][1]) for name in table}


def test_the_table_is_read_and_an_upward_import_is_caught(tmp_path):
    """The checks above are only as good as their reading of the doc and the code: a row is parsed as
    written, and an import inside a function body counts."""
    table = layer_table("### Package graph\n\n| layer | package | imports | what |\n|---|---|---|---|\n"
                        "| 1 | `a/` | — | x |\n| 2 | `a/b/` | `a` | y |\n\nprose\n| 9 | `c/` | | z |\n")
    assert table == {"a": (1, set()), "a.b": (2, {"a"})}
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from engine.kernels import selector\n    import proxy.app\n"
                      "    from .turn import Turn\n")
    assert sorted(m for m, _ in imports_of(source, ["recorder"])) == ["engine.kernels.selector", "proxy.app",
                                                                     "recorder.turn.Turn"]
    assert node_of("engine.kernels.selector", {"engine", "engine.kernels"}) == "engine.kernels"
    assert node_of("engine.sampling", {"engine", "engine.kernels"}) == "engine"


def third_party(package: str) -> dict[str, list[str]]:
    """{top-level module outside the standard library and the product: [file:line, ...]}."""
    product = product_packages()
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for module, line in imports_of(path):
            top = module.split(".")[0]
            if top and top not in sys.stdlib_module_names and top not in product and top != "__future__":
                found.setdefault(top, []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def test_the_floor_imports_only_the_standard_library_and_the_wire_httpx():
    assert third_party("prefixtrace/common") == {}
    assert set(third_party("prefixtrace/wire")) <= {"httpx"}, third_party("prefixtrace/wire")


@pytest.mark.parametrize("package", sorted(product_packages() - {"engine"}))
def test_no_package_outside_the_engine_imports_mlx(package):
    found = third_party(package)
    assert {k: v for k, v in found.items() if k in ("mlx", "mlx_lm")} == {}


def test_serve_upstream_never_imports_mlx_or_the_engine(tmp_path):
    """`prefixtrace serve --upstream URL`, the CLI's own path: once it answers /health, the process
    has imported neither MLX, mlx-lm nor the engine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = textwrap.dedent(f"""
        import os, sys, threading, time, urllib.error, urllib.request

        def watch():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    urllib.request.urlopen("http://127.0.0.1:{port}/health", timeout=5).read()
                    break
                except urllib.error.HTTPError:  # answered (the upstream is down: that may be a 503)
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                print("NO ANSWER", flush=True)
                os._exit(3)
            loaded = sorted(m for m in list(sys.modules) if m.split(".")[0] in ("mlx", "mlx_lm", "engine"))
            with open({str(tmp_path / "loaded.txt")!r}, "w") as out:  # a file: serve's own lines share stdout
                out.write("LOADED " + repr(loaded))
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()
        from prefixtrace.cli import main
        sys.argv = ["prefixtrace", "serve", "--upstream", "http://127.0.0.1:9/v1", "--port", "{port}",
                    "--db", {str(tmp_path / "t.db")!r}]
        main()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXTRACE")}
    env.update(XDG_CONFIG_HOME=str(tmp_path), PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    loaded = (tmp_path / "loaded.txt").read_text() if (tmp_path / "loaded.txt").exists() else ""
    assert loaded == "LOADED []", (loaded, proc.stdout, proc.stderr[-3000:])

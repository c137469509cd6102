"""The kernel strings handed to MLX (`mx.fast.cuda_kernel`'s source and header, per kernel) are the ones
recorded in tests/data/kernel_strings.json: a change to the files under engine/kernels/cuda/ or to how
`common.source` assembles them that alters a compiled kernel shows here, on a machine without a GPU.
A deliberate kernel change regenerates the record: `python bench/kernel_strings.py tests/data/kernel_strings.json`.
"""

import json
from pathlib import Path

import pytest

from engine.kernels import common
from engine.kernels.inventory import captured, kernel_strings

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_strings_match_the_record():
    recorded = json.loads((ROOT / "tests" / "data" / "kernel_strings.json").read_text())
    now = kernel_strings()
    assert sorted(now) == sorted(recorded)
    changed = [k for k in recorded if now[k] != recorded[k]]
    assert not changed, f"kernel strings changed: {changed}"


def test_every_kernel_is_recorded():
    # 12 kernels: dense split / MMA, reduce, generic / tq3 / tq3 reduce / tq5 / tq7, encode, two skinny GEMMs,
    # the one-row GEMV
    names = {k.split("/")[0] for k in kernel_strings()}
    assert len(names) == 12


def test_no_include_line_reaches_mlx():
    # NVRTC has no engine/kernels/cuda on its include path: every piece must be spliced in.
    for kw in captured():
        for text in (kw["source"], kw.get("header", "")):
            assert '#include "' not in text, kw["name"]
            assert "//!" not in text, kw["name"]


def _with_files(monkeypatch, tmp_path, files: dict[str, str]):
    for name, text in files.items():
        (tmp_path / "cuda").mkdir(exist_ok=True)
        (tmp_path / "cuda" / name).write_text(text)

    class Files:
        def joinpath(self, *parts):
            return tmp_path.joinpath(*parts)

    monkeypatch.setattr(common.resources, "files", lambda _pkg: Files())


def test_include_splices_with_the_lines_indentation(monkeypatch, tmp_path):
    _with_files(monkeypatch, tmp_path, {
        "k.cu": 'int a;\n    #include "p.cuh"\nint z;\n',
        "p.cuh": "//! what p is\nfor (;;) {\n\n    #include \"q.cuh\"\n}\n",
        "q.cuh": "x += 1;\n",
    })
    assert common.source("k.cu") == "int a;\n    for (;;) {\n\n        x += 1;\n    }\nint z;\n"


def test_include_cycle_is_an_error(monkeypatch, tmp_path):
    _with_files(monkeypatch, tmp_path, {"a.cuh": '#include "b.cuh"\n', "b.cuh": '  #include "a.cuh"\n'})
    with pytest.raises(ValueError, match="a.cuh -> b.cuh -> a.cuh"):
        common.source("a.cuh")

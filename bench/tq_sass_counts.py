"""SASS instruction counts per loop body of the TurboQuant split kernels (v5, v6, v7), where this
machine has nvcc and nvdisasm (the PyPI wheel nvidia-cuda-nvdisasm; not a CI tool).

Each kernel is rendered as MLX renders it (tests/test_decode_kernel_sources.py), compiled to a
sm_90 cubin and disassembled; a loop body is the code between a label and the backward branch to
it. Prints per kernel: ptxas registers / spills / static shared memory, and each loop's
instruction count with its count of LDG / LDS / HMMA / integer-address (IMAD, LEA, IADD, SHF,
LOP3, IMNMX) instructions. The K and V loops of v5 / v6 are the two largest loops after the first
(which spans most of the kernel: a loop label near its start). Variants the tree lacks are left out.

    python3 bench/tq_sass_counts.py [--nvdisasm PATH] [--variants v5,v6,v7] [--keep DIR]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import decode_attention as da  # noqa: E402
from engine import tq_mma  # noqa: E402
from tests.test_decode_kernel_sources import _PRELUDE, _TQ_INPUTS, render  # noqa: E402

_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/")  # an instruction line: its address comment
_KINDS = ("LDG", "LDS", "STS", "HMMA", "IMAD", "LEA", "IADD", "SHF", "LOP3", "IMNMX", "ISETP", "FSEL", "MOV", "BSSY", "BRA")


def kernels(variants: list[str], dtype: str = "bfloat16", dim: int = 128, g: int = 4) -> list[tuple[str, str, str]]:
    """(name, header, rendered kernel) of each variant this tree has: v5 (engine/tq_mma.py), v6 (the
    same module, where present: branch tqlean), v7 (engine/tq_fused.py, where present, with and
    without its prefetch); a variant the tree lacks is left out with a note."""
    inputs = [(n, dtype if t == "T" else t, nd) for n, t, nd in _TQ_INPUTS]
    outs = [("o_part", "float32"), ("ml_part", "float32")]
    base = da._HEADER + da._TQ3_HEADER + tq_mma.TQ4_HEADER
    got = []
    for v in variants:
        if v == "v5":
            got.append((v, base, render("k_v5", tq_mma.TQ5_SOURCE, inputs, outs, tq_mma.templates5(dtype, dim, g, 4, 64))))
        elif v == "v6" and hasattr(tq_mma, "sass_shapes6"):
            for name, src, t in tq_mma.sass_shapes6(dtype, dim, g):
                got.append((name, base + tq_mma.TQ6_HEADER, render("k_" + name, src, inputs, outs, t)))
        elif v == "v7" and importlib.util.find_spec("engine.tq_fused") is not None:
            from engine import tq_fused

            for pf in (True, False):
                name = "v7" if pf else "v7_pf0"
                got.append((name, base + tq_fused.TQ7_HEADER, render("k_" + name, tq_fused.TQ7_SOURCE, inputs, outs,
                                                                     tq_fused._templates7(dtype, dim, g, 64, pf))))
        else:
            print(f"{v}: not in this tree, left out")
    return got


def loops(sass: str) -> list[list[str]]:
    """Instruction lines of each loop body: from a label to the last branch back to it."""
    lines = sass.splitlines()
    labels = {}
    body = []
    for ln in lines:
        m = re.match(r"^\s*(\.L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = len(body)
            continue
        if _INSN.search(ln):
            body.append(ln)
    found = []
    for i, ln in enumerate(body):
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", ln)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            found.append(body[labels[m.group(1)]: i + 1])
    return found


def opcode(ln: str) -> str:
    m = re.search(r"\*/\s*(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
    return m.group(2) if m else "?"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm") or "/tmp/cutools/nvidia/cu13/bin/nvdisasm")
    ap.add_argument("--variants", default="v5,v6,v7", help="those this tree has (v6: branch tqlean; v7: engine/tq_fused.py)")
    ap.add_argument("--keep", default="", help="also write each kernel's .cu / .sass here")
    args = ap.parse_args()
    if shutil.which("nvcc") is None or not Path(args.nvdisasm).exists():
        print("needs nvcc and nvdisasm (pip download --no-deps nvidia-cuda-nvdisasm)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        for name, header, body in kernels(args.variants.split(",")):
            cu, cubin = out / f"{name}.cu", out / f"{name}.cubin"
            cu.write_text(_PRELUDE + header + body)
            r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-o", str(cubin), str(cu),
                                "-Xptxas", "-v"], capture_output=True, text=True)
            if r.returncode:
                print(name, "compile failed:", r.stderr[-2000:])
                continue
            regs = re.search(r"Used (\d+) registers", r.stderr)
            smem = re.search(r"(\d+) bytes smem", r.stderr)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
            sass = subprocess.run([args.nvdisasm, "-c", str(cubin)], capture_output=True, text=True).stdout
            (out / f"{name}.sass").write_text(sass)
            ls = sorted(loops(sass), key=len, reverse=True)
            total = sum(1 for ln in sass.splitlines() if _INSN.search(ln))
            print(f"{name}: {regs and regs.group(1)} registers, spills {spill and spill.groups()}, "
                  f"{smem and smem.group(1)} B smem, {total} instructions")
            for i, lp in enumerate(ls[:4]):
                kinds = collections.Counter(opcode(ln) for ln in lp)
                detail = ", ".join(f"{k} {sum(v for o, v in kinds.items() if o.startswith(k))}" for k in _KINDS
                                   if any(o.startswith(k) for o in kinds))
                print(f"  loop {i}: {len(lp)} instructions ({detail})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

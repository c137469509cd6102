"""How long one build of the TurboQuant CUDA-core split kernel (engine/kernels/tq_split.py) takes, per CHUNK, on this machine's CPU.

    python bench/time_kernel_builds.py [--repeat 2]

A CUDA engine compiles `mx.fast.cuda_kernel`s with NVRTC the first time a template (here
CHUNK, which grows with the context) runs. NVRTC is not on this VM; nvcc is, and does the same
front end and ptxas work for sm_90 plus a process start, which the empty kernel's time gives.
Each kernel is rendered as MLX renders it (testsupport/kernel_render.py) at
Qwen3-8B's decode shape (bf16, head 128, G 4, 4 bits, the default load width), one file each.
MLX's own header (cuda::std, its device utilities) is not in these files: NVRTC on the GPU
host parses it once per build as well. Prints JSON (seconds)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.kernels import common, tq_split  # noqa: E402
from testsupport.kernel_render import PRELUDE as _PRELUDE  # noqa: E402
from testsupport.kernel_render import TQ_INPUTS as _TQ_INPUTS  # noqa: E402
from testsupport.kernel_render import render  # noqa: E402


def build_s(work: Path, name: str, body: str) -> float:
    path = work / f"{name}.cu"
    path.write_text(_PRELUDE + common.HEADER + tq_split.SPLIT_HEADER + body)
    t0 = time.perf_counter()
    run = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", str(path), "-o", str(path) + ".cubin"],
                         capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stderr[-2000:])
    return round(time.perf_counter() - t0, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if shutil.which("nvcc") is None:
        raise SystemExit("no nvcc on this machine")
    dtype, dim, g, bits = "bfloat16", 128, 4, 4
    inputs = [(n, dtype if t == "T" else t, nd) for n, t, nd in _TQ_INPUTS]
    cpl = tq_split.cpl(g, dim, bits)
    out = {"load_average_start": round(os.getloadavg()[0], 2), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for _ in range(args.repeat):
            run = {"empty_kernel": build_s(work, "empty", "__global__ void k(float* x) { x[0] = 1.f; }\n")}
            for chunk in (64, 128, 256, 512, 1024):
                body = render("k", tq_split.SOURCE, inputs, [("o_part", "float32"), ("ml_part", "float32")],
                              tq_split.templates(dtype, dim, g, chunk, bits, 64, cpl))
                run[f"tq_split_chunk_{chunk}"] = build_s(work, f"tq_split_{chunk}", body)
            out["runs"].append(run)
    out["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

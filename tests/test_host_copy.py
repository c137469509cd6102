"""engine/host_copy.py: the disk tier's CUDA driver copy is off on the CPU, and its one kernel
compiles as MLX renders it (the GPU run, bench/bench_engine_speed.py, checks the bytes)."""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import pytest

from engine import cache_blocks, host_copy
from tests.test_decode_kernel_sources import _PRELUDE


def test_no_driver_copy_on_the_cpu():
    """CI has no GPU: the flat staging is never chosen by itself there, whatever HOST_COPY says."""
    assert not host_copy.available()
    staged, device = cache_blocks.stage({"0.k": mx.zeros((1, 1, 2, 4))}, copy=True)
    assert isinstance(staged, dict) and len(device) == 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine (CI): nothing to compile with")
def test_address_kernel_compiles_for_the_h200(tmp_path):
    # As mlx/backend/cuda/custom_kernel.cpp's build_kernel writes it: the input, its strides
    # (the body names them), the output.
    src = tmp_path / "address.cu"
    src.write_text(_PRELUDE + "__global__ void address(const uint8_t* flat, const __grid_constant__ Strides "
                   "flat_strides, uint64_t* out) {\n" + host_copy._POINTER_SOURCE + "\n}\n")
    run = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "a.o")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]

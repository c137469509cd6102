"""The OpenBLAS re-exec and the activation-dtype loader of engine.cpu_runtime."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load, save_model

from engine import cpu_runtime

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL = ROOT / "fixtures" / "tiny-llama"

# Calls maybe_reexec_with_openblas, then reports what the (possibly re-exec'd)
# process sees. Its arguments must survive the re-exec unchanged.
PROBE = """
import json, logging, os, sys
sys.path.insert(0, {root!r})
logging.basicConfig(level=logging.DEBUG, format="LOG %(message)s")
from engine import cpu_runtime
cpu_runtime.maybe_reexec_with_openblas()
print(json.dumps({{"ld_preload": os.environ.get("LD_PRELOAD", ""),
                   "marker": os.environ.get(cpu_runtime.PRELOADED_ENV, ""),
                   "argv": sys.argv[1:]}}))
"""

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD re-exec is Linux-only")


def _probe(tmp_path: Path, **env_extra: str) -> tuple[dict, str]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(root=str(ROOT)))
    drop = ("LD_PRELOAD", cpu_runtime.PRELOADED_ENV, cpu_runtime.NO_OPENBLAS_ENV, cpu_runtime.OPENBLAS_ENV)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra)
    done = subprocess.run(
        [sys.executable, str(script), "serve", "--port", "0"],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _system_lib(name: str) -> str:
    # Stand-ins for OpenBLAS: any real shared object preloads harmlessly, and
    # the re-exec logic never looks inside the library.
    for arch in ("x86_64-linux-gnu", "aarch64-linux-gnu"):
        path = Path(f"/lib/{arch}/{name}")
        if path.exists():
            return str(path)
    pytest.skip(f"no {name} to preload")


@linux_only
def test_reexec_sets_ld_preload_once_and_keeps_argv(tmp_path):
    lib = _system_lib("libc.so.6")
    seen, stderr = _probe(tmp_path, PREFIXTRACE_OPENBLAS=lib)
    assert seen["ld_preload"] == lib
    assert seen["marker"] == lib
    assert seen["argv"] == ["serve", "--port", "0"]
    assert stderr.count("re-executing with LD_PRELOAD") == 1  # one line, and no loop


@linux_only
def test_reexec_prepends_to_an_existing_preload(tmp_path):
    lib, libm = _system_lib("libc.so.6"), _system_lib("libm.so.6")
    seen, _ = _probe(tmp_path, PREFIXTRACE_OPENBLAS=lib, LD_PRELOAD=libm)
    assert seen["ld_preload"] == f"{lib}:{libm}"


@linux_only
def test_no_reexec_when_library_already_preloaded(tmp_path):
    lib = _system_lib("libc.so.6")
    seen, stderr = _probe(tmp_path, PREFIXTRACE_OPENBLAS=lib, LD_PRELOAD=lib)
    assert seen["ld_preload"] == lib and seen["marker"] == ""
    assert "re-executing" not in stderr


@linux_only
def test_opt_out_env_var_disables_reexec(tmp_path):
    seen, stderr = _probe(tmp_path, PREFIXTRACE_OPENBLAS=_system_lib("libc.so.6"), PREFIXTRACE_NO_OPENBLAS="1")
    assert seen["ld_preload"] == "" and seen["marker"] == ""
    assert "re-executing" not in stderr


@linux_only
def test_missing_openblas_logs_install_hint(tmp_path):
    seen, stderr = _probe(tmp_path, PREFIXTRACE_OPENBLAS=str(tmp_path / "absent.so"))
    assert seen["ld_preload"] == ""
    assert "apt-get install libopenblas0-pthread" in stderr
    assert len([line for line in stderr.splitlines() if "BLAS" in line]) == 1


def test_find_openblas_takes_first_existing(tmp_path):
    present = tmp_path / "libopenblas.so.0"
    present.write_bytes(b"")
    assert cpu_runtime.find_openblas((tmp_path / "absent.so", present)) == present
    assert cpu_runtime.find_openblas((tmp_path / "absent.so",)) is None


def test_default_dtype_is_float32_off_apple_silicon(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    assert cpu_runtime.default_dtype() == "float32"
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(cpu_runtime.platform, "machine", lambda: "arm64")
    assert cpu_runtime.default_dtype() == "bfloat16"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_load_model_sets_activation_dtype(dtype):
    model, tokenizer = cpu_runtime.load_model(TINY_MODEL, dtype)
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    logits = model(mx.array([ids]))
    assert logits.dtype == getattr(mx, dtype)


def test_load_model_casts_floats_but_not_packed_weights(tmp_path):
    # A quantized copy of the tiny model, with float16 scales like a GGUF import.
    model, tokenizer = load(str(TINY_MODEL))
    nn.quantize(model, group_size=32, bits=4)
    model.set_dtype(mx.float16)
    out = tmp_path / "q"
    out.mkdir()
    save_model(out, model)
    config = json.loads((TINY_MODEL / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((TINY_MODEL / name).read_bytes())

    model, tokenizer = cpu_runtime.load_model(out, "float32")
    dtypes = {name: value.dtype for name, value in tree_flatten(model.parameters())}
    assert dtypes["model.embed_tokens.scales"] == mx.float32
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == mx.uint32
    assert dtypes["model.norm.weight"] == mx.float32
    logits = model(mx.array([tokenizer.encode("hello", add_special_tokens=False)]))
    assert logits.dtype == mx.float32


def test_load_model_rejects_unknown_dtype():
    from prefixtrace.common.errors import EngineError

    with pytest.raises(EngineError, match="float64"):
        cpu_runtime.load_model(TINY_MODEL, "float64")


# --- the pip-installed OpenBLAS (no apt step) --------------------------------------------------

MATMUL_PROBE = """
import json, sys
sys.path.insert(0, {root!r})
from engine import cpu_runtime
cpu_runtime.maybe_reexec_with_openblas()
import mlx.core as mx, numpy as np
a = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
got = np.array(mx.matmul(mx.array(a), mx.array(a), stream=mx.cpu))
maps = open("/proc/self/maps").read()
print(json.dumps({{"err": float(np.abs(got - a @ a).max()), "mapped": "libprefixtrace_openblas" in maps}}))
"""


@linux_only
def test_without_debian_openblas_the_pip_one_is_found(tmp_path, monkeypatch):
    pytest.importorskip("scipy_openblas32")
    monkeypatch.setattr(cpu_runtime, "OPENBLAS_CANDIDATES", (tmp_path / "no-debian" / "libopenblas.so.0",))
    monkeypatch.delenv(cpu_runtime.OPENBLAS_ENV, raising=False)
    monkeypatch.setenv("PREFIXTRACE_CACHE_DIR", str(tmp_path / "cache"))
    found = cpu_runtime.find_openblas()
    assert found is not None and found.parent == tmp_path / "cache" / "blas"
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(found)], capture_output=True, text=True).stdout
    defined = {line.split()[-1] for line in symbols.splitlines() if " T " in line}
    assert set(cpu_runtime.MLX_BLAS_SYMBOLS) <= defined  # the plain names MLX imports
    assert cpu_runtime.find_openblas() == found  # prepared once, then reused


@pytest.mark.slow
@linux_only
def test_serve_preloads_the_pip_openblas_and_mlx_uses_it(tmp_path):
    """As on a fresh machine without libopenblas0-pthread: the re-exec preloads the renamed
    wheel library, MLX's CPU matmul resolves to it and gives numpy's result."""
    pytest.importorskip("scipy_openblas32")
    seen, stderr = _probe(tmp_path, PREFIXTRACE_OPENBLAS="pip", PREFIXTRACE_CACHE_DIR=str(tmp_path / "cache"))
    assert "libprefixtrace_openblas" in seen["ld_preload"] and seen["marker"]
    script = tmp_path / "matmul.py"
    script.write_text(MATMUL_PROBE.format(root=str(ROOT)))
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", cpu_runtime.PRELOADED_ENV)}
    env.update(PREFIXTRACE_OPENBLAS="pip", PREFIXTRACE_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["mapped"] and result["err"] < 1e-2

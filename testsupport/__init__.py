"""Helpers that both the tests (tests/) and the benchmarks (bench/) use, so that neither imports the other.

Not part of the product: nothing in prefixtrace/, proxy/, engine/, analyzer/ or recorder/ imports it, and
it is not in the wheel (pyproject's package list); pytest finds it through `pythonpath = ["."]`, the bench
scripts through the repository root they put on sys.path. tests/test_bench_tests_apart.py holds the rule.

    servers        a real uvicorn server on a thread; `prefixtrace serve` as a subprocess; stopping one
    fleet          `prefixtrace serve` workers, sglang-router / vllm-router, a front proxy (docs/FLEET.md)
    recorder_soak  streaming clients hanging up at random against a real server
    harness_session  a scripted coding-harness session's request bodies; a model dir with another template
    redact_bodies  ordinary and adversarial bodies for the redactor's linear-time bound
    synthetic_log  the field-report-shaped synthetic recording
    otlp_receiver  an OTLP/HTTP trace receiver on loopback
    volatile_session  a session whose system prompt carries a per-turn timestamp, played against a proxy
    kernel_render  a kernel body as MLX renders it, and nvcc's report on it (CUDA checks without a GPU)
    kernel_inventory  every kernel string the engine hands to MLX, as sha256s (bench/kernel_strings.py)
    tq_quality     how close a TurboQuant cache comes to the dense one (bench/bench_turboquant.py)
    forced_pauses  pauses and parks forced at chosen points, a seam around the scheduler's steps
"""

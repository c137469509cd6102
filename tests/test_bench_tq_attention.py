"""bench/bench_tq_attention.py's queued mode (what an engine token does: L layers queued, one eval)
on the CPU, where the kernels are absent and the TurboQuant figure is the MLX-ops path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_tq_attention", ROOT / "bench" / "bench_tq_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_queued_layers_caps_what_the_dense_caches_would_take():
    b = _bench()
    # one Qwen3-8B layer at 100k, bf16: 2 x 8 x 100k x 128 x 2 B = 410 MB; 8 rows: 3.3 GB
    assert b.queued_layers(100_000, 1, 8, 128, mx.bfloat16, 36, 40.0) == 36
    assert b.queued_layers(100_000, 8, 8, 128, mx.bfloat16, 36, 40.0) == 12
    assert b.queued_layers(10**9, 8, 8, 128, mx.bfloat16, 36, 1.0) == 1


def test_queued_mode_reports_per_layer_figures_beside_the_synced_ones():
    b = _bench()
    row = b.measure("smollm2-135m", 200, 4, mx.float32, steps=4, rows=2, queued=3)
    assert row["queued_layers"] == 3
    assert row["queued_dense_ms"] > 0 and row["queued_tq_mlx_ops_ms"] > 0 and row["dense_ms"] > 0
    only = b.measure("smollm2-135m", 200, 4, mx.float32, steps=4, rows=1, queued=2, only_queued=True)
    assert "dense_ms" not in only and only["queued_dense_ms"] > 0


def test_queued_chain_feeds_each_layer_the_previous_output():
    """The queued token is a dependency chain (a layer's output is the next one's query), so the
    time covers L steps in order; with one layer it is one synced step's work."""
    from mlx_lm.models.cache import KVCache

    b = _bench()
    made = []

    def make():
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, 8, 4)), mx.zeros((1, 1, 8, 4)))
        made.append(c)
        return c

    t = b.queued_step_time(make, "dense", 3, 2, 1, 4, mx.float32, steps=4)
    assert t > 0 and len(made) == 3 and all(c.offset == 8 + 4 for c in made)


_NCU_HEAD = '''==PROF== Connected to process 4242 (/opt/torch/.venv/bin/python3.12)
==PROF== Profiling "custom_kernel_prefixtrace_decode_tq4_bfloat16_128_4" - 0: 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
'''
# (id, stream, kernel, unit, value): dense two steps (K, V writes, SDPA), then v4 one step; an
# input-making kernel (mx.random) between them, as a window opened too early caught them.
_NCU_ROWS = [
    (0, 7, "void mlx::copy_gg_nd<bf16>", "nsecond", "2,080"), (1, 8, "void mlx::copy_gg_nd<bf16>", "nsecond", "1,920"),
    (2, 7, "cudnn_generated_fort_native_sdpa_sm80_flash_fprop", "usecond", "61.5"),
    (3, 7, "mlx::rbitsc(const unsigned int *)", "usecond", "2.5"),
    (4, 9, "void mlx::copy_gg_nd<bf16>", "nsecond", "2,000"), (5, 7, "void mlx::copy_gg_nd<bf16>", "nsecond", "2,000"),
    (6, 7, "cudnn_generated_fort_native_sdpa_sm80_flash_fprop", "usecond", "62.5"),
    (7, 7, "void cudnn::lean_reduction_kernel<0, 0, 0>", "usecond", "4"),
    (8, 9, "void mlx::copy_gg_nd<bf16>", "nsecond", "2,000"), (9, 7, "void mlx::copy_gg_nd<bf16>", "nsecond", "2,000"),
    (10, 7, "mlx::custom_kernel_prefixtrace_decode_tq4_bfloat16_128_4", "usecond", "40"),
    (11, 7, "mlx::custom_kernel_prefixtrace_decode_tq3_reduce_bfloat16_128_4", "usecond", "4"),
]
_NCU_CSV = _NCU_HEAD + "".join(
    f'"{i}","4242","python3.12","127.0.0.1","{k}","1","{st}","(128, 1, 1)","(99, 8, 1)","0","9.0",'
    f'"Command line profiler metrics","gpu__time_duration.sum","{u}","{v}"\n' for i, st, k, u, v in _NCU_ROWS)


def test_ncu_csv_summed_per_case_and_step():
    """The kernel-time mode's parse: ncu's messages skipped, units and thousands separators read;
    steps found where the cache-update copies start (not by ncu's streams: MLX spreads one
    stream's kernels over several CUDA streams), input-making kernels left out, steps assigned
    to the cases in order and the sums divided by each case's steps."""
    b = _bench()
    kernels = b.parse_ncu_csv(_NCU_CSV)
    assert [k["id"] for k in kernels] == list(range(12))
    assert kernels[0]["us"] == 2.08 and kernels[2]["us"] == 61.5
    cases = [{"case": "dense", "context": 32768, "rows": 1, "steps": 2},
             {"case": "v4", "context": 32768, "rows": 1, "steps": 1}]
    dense, v4 = b.kernel_summary(kernels, cases)
    assert dense["case"] == "dense" and dense["launches_per_step"] == 3.5
    assert dense["kernel_us_per_step"] == round((2.08 + 1.92 + 61.5 + 2 + 2 + 62.5 + 4) / 2, 2)
    assert dense["copy_us"] == 4.0 and dense["sdpa_us"] == 64.0 and "input_us" not in dense
    assert v4["tq_split_us"] == 40.0 and v4["tq_reduce_us"] == 4.0 and v4["launches_per_step"] == 4
    assert b.parse_ncu_csv("==PROF== nothing profiled\n") == []


def test_sync_floor_grows_with_the_launches():
    b = _bench()
    floors = b.sync_floors(steps=3, top=2)
    assert set(floors) == {"sync_floor_add_1_ms", "sync_floor_add_2_ms"}  # (no custom kernels on the CPU)
    assert all(v > 0 for v in floors.values())


def test_forced_chunk_sets_the_split_and_restores_it():
    from engine import decode_attention

    b = _bench()
    saved = decode_attention.split_chunk
    with b.forced_chunk(512):
        assert decode_attention.split_chunk(100_000, 8, 1, 4) == 512
        assert decode_attention.split_chunk(100_000, 8, 1, 4, at_least=600) == 1024  # the window's block
    assert decode_attention.split_chunk is saved
    with b.forced_chunk(None):
        assert decode_attention.split_chunk is saved


def test_kernel_cases_run_without_a_profiler():
    """On the CPU the capture window is a no-op (`profiler` answers False) and the cases still run."""
    b = _bench()
    out = b.kernel_cases("smollm2-135m", 130, 4, mx.float32, 1, ("v4",), 2, (64,), (4,), True)
    assert [c["case"] for c in out] == ["dense", "v4", "v4_chunk64", "v5_u4", "v5_nofold"]
    assert all(c["profiler"] is False and c["steps"] == 2 for c in out)


def test_tq5_unroll_sets_v5s_tiles_in_flight_and_restores_them():
    from engine import tq_mma

    b = _bench()
    before = tq_mma.tq5_unroll()
    with b.tq5_unroll(4):
        assert tq_mma.tq5_unroll() == 4
        assert dict(tq_mma.templates5(mx.bfloat16, 128, 4, 4, 64, tq_mma.tq5_unroll()))["U"] == 4
    assert tq_mma.tq5_unroll() == before


def test_ncu_raw_page_gives_time_conflicts_and_the_largest_stalls():
    b = _bench()
    head = ['"ID"', '"Kernel Name"', '"Grid Size"', '"gpu__time_duration.sum"',
            '"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"',
            '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"',
            '"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"',
            '"smsp__average_warps_issue_stalled_not_issued_per_issue_active.ratio"']
    units = ['""', '""', '""', '"nsecond"', '""', '"ratio"', '"ratio"', '"ratio"']
    row = ['"0"', '"custom_kernel_prefixtrace_decode_tq4"', '"(99, 8, 8)"', '"812,000"', '"1,024"', '"7.5"', '"0.5"', '"9"']
    text = "==PROF== done\n" + "\n".join(",".join(r) for r in (head, units, row))
    (k,) = b.ncu_counters(text)
    assert k["us"] == 812.0 and k["smem_ld_conflicts"] == 1024 and k["dram_pct"] is None
    assert k["stall_long_scoreboard"] == 7.5 and k["stall_barrier"] == 0.5 and "stall_not_issued" not in k

# Session 9, tqfused, start 1: v7 (engine/tq_fused.py) correctness, then ncu kernel times beside v4 / v5.
# Each step under its own timeout; everything under $OUT (logs as they go). A smoke failure (v7 does not
# build or is wrong at 5k) stops the run after the smoke. DRY=1: the VM's CPU dry-run (small contexts, no ncu).
set -o pipefail
export PYTHONPATH=$PWD:$PYTHONPATH
O=${OUT:-/tmp/tqfused-out}; mkdir -p $O
B=bench/bench_tq_attention.py
C32=32768; C100=100000; NCU="ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum"
if [ -n "$DRY" ]; then C32=1024; C100=2048; NCU=""; fi
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $O/gpu.txt 2>&1
stamp "smoke"
timeout 30 python3 bench/smoke_tq_variant.py --variants v7,v5 --context 5000 > $O/smoke.log 2>&1
rc=$?; stamp "smoke rc=$rc"; cut -c1-300 $O/smoke.log
if [ $rc -ne 0 ]; then stamp "smoke failed: stopping"; exit 1; fi
# 1. correctness, long rows: one row of 32k / 100k (3 steps), four left-padded rows at each (2 steps), bf16
timeout 45 python3 bench/check_decode_kernels.py --skip-dense --variants v7 --unrolls "" --tq3-loads "" --greedy-dtypes "" \
  --only-long --long --json $O/check-long.json > $O/check-long.log 2>&1
stamp "check-long rc=$?"; grep -c '"ok": true' $O/check-long.log; grep '"ok": false' $O/check-long.log | cut -c1-300; tail -1 $O/check-long.log | cut -c1-200
# 2. ncu kernel time, one row: dense, v4, v5 (unfolded: the default), v7, v7 with one tile buffer at 32k and 100k
timeout 70 $NCU ${NCU:+--log-file $O/K1.csv} python3 $B --shape qwen3-8b --context $C32 --context $C100 --rows 1 \
  --kernel-time --kernel-steps 3 --kernel-variants v4,v5,v7 --tq7-pf0 --json $O/kt1.json > $O/kt1.log 2>&1
stamp "kt1 rc=$?"
[ -z "$DRY" ] && timeout 10 python3 $B --ncu-csv $O/K1.csv --kernel-cases $O/kt1.json --json $O/ktsum1.json > $O/ktsum1.txt 2>&1
stamp "ktsum1 rc=$?"; cut -c1-260 $O/ktsum1.txt 2>/dev/null | grep case
# 3. ncu kernel time, 8 rows of 100k: dense, v5, v7, v7 with one tile buffer
timeout 50 $NCU ${NCU:+--log-file $O/K8.csv} python3 $B --shape qwen3-8b --context $C100 --rows 8 \
  --kernel-time --kernel-steps 2 --kernel-variants v5,v7 --tq7-pf0 --json $O/kt8.json > $O/kt8.log 2>&1
stamp "kt8 rc=$?"
[ -z "$DRY" ] && timeout 10 python3 $B --ncu-csv $O/K8.csv --kernel-cases $O/kt8.json --json $O/ktsum8.json > $O/ktsum8.txt 2>&1
stamp "ktsum8 rc=$?"; cut -c1-260 $O/ktsum8.txt 2>/dev/null | grep case
ls -la $O

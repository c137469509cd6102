# Session 9, tqfused, start 2: v7 (lazy rescale; one and two tile buffers) — the short checks it maps and the
# wide model's greedy tokens, then ncu kernel time at 1 / 8 rows x 32k / 100k, then the synced + queued
# per-layer figures at one row beside v4 / v5. Each step under its own timeout; everything under $OUT,
# tarred into $OUT/tqfused-s9b.tgz at the end. DRY=1: the VM's CPU dry-run (small contexts, no ncu).
set -o pipefail
export PYTHONPATH=$PWD:$PYTHONPATH
O=${OUT:-/tmp/tqfused-out}; mkdir -p $O/r
B=bench/bench_tq_attention.py
C32=32768; C100=100000; NCU="ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum"
if [ -n "$DRY" ]; then C32=1024; C100=2048; NCU=""; fi
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $O/r/log; }
# 1. correctness: the short cases v7 maps (bf16 / f16; G 1 / 3 / 4 / 8, D 64 / 128, left-padded batches, runs of
#    steps across group boundaries; D = 256 handed to v5), then greedy tokens on the wide model (bf16), v4 and v7
timeout 45 python3 bench/check_decode_kernels.py --skip-dense --variants v7 --unrolls "" --tq3-loads "" --greedy-dtypes "" \
  --mapped-only --greedy-wide bfloat16 --greedy-variants v4,v7 --steps 64 --json $O/r/check-short.json > $O/r/check-short.log 2>&1
stamp "check-short rc=$?"; grep -c '"ok": true' $O/r/check-short.log; grep '"ok": false' $O/r/check-short.log | cut -c1-300; grep greedy $O/r/check-short.log | cut -c1-250
# 2. ncu kernel time: dense, v7, v7 with one tile buffer at 1 and 8 rows x 32k and 100k (v4 / v5: start 1's figures)
timeout 55 $NCU ${NCU:+--log-file $O/r/K.csv} python3 $B --shape qwen3-8b --context $C32 --context $C100 --rows 1 --rows 8 \
  --kernel-time --kernel-steps 2 --kernel-variants v7 --tq7-pf0 --json $O/r/kt.json > $O/r/kt.log 2>&1
stamp "kt rc=$?"
# 3. synced + queued per layer, one row, 32k and 100k: dense, v4, v5, v7, v7 with one tile buffer
timeout 45 python3 $B --shape qwen3-8b --context $C32 --context $C100 --rows 1 --steps 12 --only-tq \
  --variants v4,v5,v7 --tq7-pf0 --queued --json $O/r/queued.json > $O/r/queued.log 2>&1
stamp "queued rc=$?"; grep '"context"' $O/r/queued.log | cut -c1-600
cp $O/r/log $O/log 2>/dev/null
tar czf $O/tqfused-s9b.tgz -C $O r && ls -la $O

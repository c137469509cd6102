# Session 9, tqfused, start 2: v7's short checks (bf16 / f16 shapes it maps) and the queued per-layer figure
# beside v4 / v5. Each step under its own timeout; everything under $OUT. DRY=1: the VM's CPU dry-run.
set -o pipefail
export PYTHONPATH=$PWD:$PYTHONPATH
O=${OUT:-/tmp/tqfused-out}; mkdir -p $O
B=bench/bench_tq_attention.py
C32=32768; C100=100000
if [ -n "$DRY" ]; then C32=1024; C100=2048; fi
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
# 1. queued (36 layers a token, one eval), one row, 32k and 100k: dense, v4, v5, v7, v7 with one tile buffer
timeout 50 python3 $B --shape qwen3-8b --context $C32 --context $C100 --rows 1 --steps 12 --only-tq \
  --variants v4,v5,v7 --tq7-pf0 --queued --json $O/queued.json > $O/queued.log 2>&1
stamp "queued rc=$?"; grep '"context"' $O/queued.log | cut -c1-1500
# 2. correctness, the short cases v7 maps (bf16 / f16; G 1 / 3 / 4 / 8, D 64 / 128, B = 8; D = 256 handed to v5)
timeout 45 python3 bench/check_decode_kernels.py --skip-dense --variants v7 --unrolls "" --tq3-loads "" --greedy-dtypes "" \
  --mapped-only --json $O/check-short.json > $O/check-short.log 2>&1
stamp "check-short rc=$?"; grep -c '"ok": true' $O/check-short.log; grep '"ok": false' $O/check-short.log | cut -c1-300
ls -la $O

# Session 9, tqfused, start 3: the v7 checks start 2's cut run missed: f16 first, then bf16; G = 3 (D = 64),
# four left-padded rows at G = 4, B = 8 at G = 8, G = 1 with two padded rows; runs of 20 steps across group
# boundaries; every step must launch v7's own kernel (`v7_launches`). Everything under $OUT, one tgz.
set -o pipefail
export PYTHONPATH=$PWD:$PYTHONPATH
O=${OUT:-/tmp/tqfused-out}; mkdir -p $O/r
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $O/r/log; }
timeout 110 python3 bench/check_decode_kernels.py --skip-dense --variants v7 --unrolls "" --tq3-loads "" --greedy-dtypes "" \
  --mapped-only --mapped-dtypes float16,bfloat16 --mapped-cases d64,pad,b8,g1 --json $O/r/check-mapped.json > $O/r/check-mapped.log 2>&1
stamp "check-mapped rc=$?"; grep -c '"ok": true' $O/r/check-mapped.log | tee -a $O/r/log; grep '"ok": false' $O/r/check-mapped.log | cut -c1-300 | tee -a $O/r/log
tail -1 $O/r/check-mapped.log | cut -c1-200 | tee -a $O/r/log
cp $O/r/log $O/log; tar czf $O/tqfused-s9c.tgz -C $O r && ls -la $O

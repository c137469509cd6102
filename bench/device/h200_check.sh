# The H200 check after a change to engine/kernels/: the kernel checks (production dispatch and each
# fall-back, 32k / 100k rows included), one layer's step dense vs TurboQuant, and the engine speed figures
# (TurboQuant vs dense decode through the engine at 32k / 100k; the engine's own decode section), in one
# command of at most ~9 minutes (each step's timeout: 340 + 130 + 90 + 100 s; ~8-9 minutes in practice; on a fresh machine the checks alone take ~310 s, the first kernel compiles included).
#
# How to run it (two `run` calls, as MLX's CUDA build is carried in two parts; see bench/README.md):
#   1. carry [".gpu1"]:  mkdir -p /tmp/p && cp .gpu1/part_aa /tmp/p/
#   2. within 30 s, carry [".gpu2"]:  source .gpu2/install.sh && bash bench/device/h200_check.sh
# Everything lands under $OUT (logs as they go), tarred into $OUT/h200-check.tgz at the end; the summary
# lines are printed. Each step runs under its own timeout, so one that hangs cannot take the others' time.
# DRY=1: a CPU dry run of the plumbing (small contexts; the kernel check says "nothing to check").
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
O=${OUT:-/tmp/h200-check}; mkdir -p $O/r
C32=32768; C100=100000; STEPS=200; SPEED="--random qwen3-8b"
if [ -n "$DRY" ]; then C32=512; C100=1024; STEPS=8; SPEED=""; fi
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $O/r/log; }
git rev-parse HEAD > $O/r/commit.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $O/r/gpu.txt 2>&1
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device())" > $O/r/mlx.txt 2>&1
cat $O/r/gpu.txt $O/r/mlx.txt | tee -a $O/r/log

# 1. kernel checks: dense and TurboQuant against SDPA, each case's kernel route, greedy-token identity,
#    one row / four left-padded rows at 32k and 100k (~4-5 min: the split kernels compile once per chunk)
timeout 340 python3 bench/check_decode_kernels.py --long --steps $STEPS --json $O/r/check.json > $O/r/check.log 2>&1
stamp "check rc=$?"
grep -c '"ok": true' $O/r/check.log | sed 's/^/checks ok: /' | tee -a $O/r/log
grep '"ok": false' $O/r/check.log | cut -c1-300 | head -20 | tee -a $O/r/log
tail -1 $O/r/check.log | cut -c1-400 | tee -a $O/r/log

# 2. engine decode, dense vs TurboQuant (Qwen3-8B shape, random bf16 weights, one row), 32k and 100k
timeout 130 python3 bench/bench_turboquant.py --engine-decode $C32 --engine-decode $C100 ${DRY:+--engine-shape tiny --engine-tokens 8 --engine-warmup 0} \
  --json $O/r/engine-decode.json > $O/r/engine-decode.log 2>&1
stamp "engine-decode rc=$?"
grep -A4 '"ratios"' $O/r/engine-decode.json 2>/dev/null | tee -a $O/r/log

# 3. one layer's decode step, dense vs TurboQuant through the production kernels (synced), 1 and 8 rows
timeout 90 python3 bench/bench_decode_kernels.py --context $C32 --context $C100 --rows 1 --rows 8 ${DRY:+--shape smollm2-135m --dtype float32 --steps 4} \
  --json $O/r/decode-kernels.json > $O/r/decode-kernels.log 2>&1
stamp "decode-kernels rc=$?"
cut -c1-300 $O/r/decode-kernels.log | grep context | tee -a $O/r/log

# 4. the engine speed bench's decode section (batched decode through the engine's kernels)
timeout 100 python3 bench/bench_engine_speed.py $SPEED --only decode --out $O/r/engine-speed.json > $O/r/engine-speed.log 2>&1
stamp "engine-speed rc=$?"
tail -5 $O/r/engine-speed.log | cut -c1-300 | tee -a $O/r/log

cp $O/r/log $O/log 2>/dev/null
tar czf $O/h200-check.tgz -C $O r && ls -la $O

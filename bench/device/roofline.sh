# Issue 35's figures on the H200 in one call: the GEMV checked against MLX's matmul at every Qwen3-8B
# shape and plan, then bench/bench_decode_roofline.py (three processes: bytes per step and the roofline,
# the HBM's measured bandwidth, MLX's and the GEMV's weight reads, B = 1 / B = 8 through the engine
# against mlx-lm, TurboQuant vs dense at 32k / 100k with what tells the causes of its swing apart).
#
# How to run it (two `run` calls, as MLX's CUDA build is carried in two parts; see bench/README.md):
#   1. carry [".gpu1"]:  mkdir -p /tmp/p && cp .gpu1/part_aa /tmp/p/
#   2. within 30 s, carry [".gpu2"]:  source .gpu2/install.sh && bash bench/device/roofline.sh
# Everything lands under $OUT (logs as they go), tarred into $OUT/roofline.tgz at the end; the summary is
# printed. Each step runs under its own timeout (30 + 540 s; each of the three processes at most 175 s), so a hang cannot take the other's time.
# DRY=1: a CPU dry run of the plumbing (the small model, small contexts, two processes).
set -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
O=${OUT:-/tmp/roofline}; mkdir -p $O/r
ARGS="--json $O/r/roofline.json"
if [ -n "$DRY" ]; then ARGS="$ARGS --shape small --processes 2 --tokens 8 --tq-tokens 4 --contexts 512 --warmup 0 --copy-gib 0.25 --chunk 256 --child-timeout 400"; fi
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*" | tee -a $O/r/log; }
git rev-parse HEAD > $O/r/commit.txt 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,power.limit --format=csv > $O/r/gpu.txt 2>&1
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device())" > $O/r/mlx.txt 2>&1
cat $O/r/gpu.txt $O/r/mlx.txt | tee -a $O/r/log

# 1. the GEMV against MLX's matmul (float32 reference) at every shape of the model and every plan
timeout 30 python3 bench/check_gemv.py > $O/r/check-gemv.log 2>&1
stamp "check-gemv rc=$?"
tail -3 $O/r/check-gemv.log | cut -c1-400 | tee -a $O/r/log

# 2. the figures, three processes (each ~100-160 s: the model build ~30 s, 100k prefills the most)
timeout 540 python3 bench/bench_decode_roofline.py $ARGS > $O/r/roofline.log 2> $O/r/roofline.err
stamp "roofline rc=$?"
cut -c1-220 $O/r/roofline.log | tee -a $O/r/log
tail -5 $O/r/roofline.err | cut -c1-300 | tee -a $O/r/log

cp $O/r/log $O/log 2>/dev/null
tar czf $O/roofline.tgz -C $O r && ls -la $O

#!/usr/bin/env bash
# The GPU benchmark suite behind docs/performance.md, in one call (writes everything under $OUT).
# (The dated A/B suites of earlier runs are in git history; their switches are decided and gone.)
#   OUT=/tmp/out bash benchmarks/gpu_suite.sh
# Needs mlx (CUDA), mlx-lm, trio, hypercorn, quart-trio importable (PYTHONPATH). Each step has its
# own time limit so one slow step cannot starve the rest; results land as they finish, and are
# packed into $OUT/results.tgz (the device tool returns at most 8 files).
# Smoke test on CPU: OUT=/tmp/gs Q06=cpu-small L8=cpu-small STEPS=16 MT=16 bash benchmarks/gpu_suite.sh
set -u
OUT=${OUT:-/tmp/out}
# Results gather in $RES (outside $OUT) and are re-packed into $OUT/results.tgz after every step,
# so a call cut short still returns everything finished so far.
RES=${RES:-/tmp/res}
rm -rf "$RES" && mkdir -p "$RES" "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PATH="$HOME/site/bin:$PATH"  # py-spy, when installed with --target $HOME/site
LOG="$RES/log.txt"
pack() { tar czf "$OUT/results.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"; cp "$LOG" "$OUT/log.txt"; }
step() { local limit=$1; shift; echo "== $(date +%T) [$limit s] $*" | tee -a "$LOG"; timeout "$limit" "$@" >>"$LOG" 2>&1; echo "== rc=$? $(date +%T)" | tee -a "$LOG"; pack; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv >"$RES/gpu.txt" 2>&1
python3 -c "import mlx.core as mx, mlx_lm, platform; print(mx.__version__, mlx_lm.__version__, platform.python_version(), mx.default_device(), mx.device_info())" >>"$RES/gpu.txt" 2>&1
lscpu | head -20 >>"$RES/gpu.txt"

M=${MODELS:-/tmp/models}
mkdir -p $M
Q06=${Q06:-qwen3-0.6b}; L8=${L8:-llama3-8b}; STEPS=${STEPS:-128}; MT=${MT:-128}
DE="python3 benchmarks/decode_engine.py --steps $STEPS"
SB="python3 benchmarks/serve_bench.py"

# py-spy (if installed) on our server at c=32: per-thread profile with GIL-free waits left out.
spy_c32() {
  command -v py-spy >/dev/null || { echo "no py-spy" >>"$LOG"; return; }
  echo "== $(date +%T) py-spy c=32 on $1" | tee -a "$LOG"
  timeout 120 $SB --model $M/$1 --dtype bfloat16 --max-tokens 256 --concurrency 32 --repeats 4 --only ours \
    --agent-turns 0 --joiner-words 0 --no-abort --exit-streams 0 --out "$RES/sb-$1-spy.json" >>"$LOG" 2>&1 &
  local bench=$! pid=""
  for _ in $(seq 60); do pid=$(pgrep -f "actors.serve" | head -1); [ -n "$pid" ] && break; sleep 0.5; done
  sleep 8  # past start-up and the first repeat's compiles
  [ -n "$pid" ] && timeout 30 py-spy record -p "$pid" -d 8 -r 250 --threads -f raw -o "$RES/spy-$1-c32.raw" --nonblocking >>"$LOG" 2>&1
  wait $bench
  python3 benchmarks/pyspy_summary.py "$RES/spy-$1-c32.raw" 40 >"$RES/spy-$1-c32.txt" 2>>"$LOG"
  pack
}

# the full run behind docs/performance.md
step 60 python3 benchmarks/synth_fast.py $M/q06-bf16 $Q06 bfloat16 none
# first-time cost of new attention shapes, and bucketed / grouped prefill against exact widths
step 150 python3 benchmarks/shape_cost.py --model $M/q06-bf16 --out "$RES/shape-q06-bf16.json"
step 120 $DE --model $M/q06-bf16 --batches 1,8,32 --repeats 2 --out "$RES/de-q06-bf16.json"
step 90 python3 benchmarks/synth_fast.py $M/l8-bf16 $L8 bfloat16 none
step 120 $DE --model $M/l8-bf16 --batches 1,8 --repeats 2 --out "$RES/de-l8-bf16.json"
rm -rf $M/l8-bf16
step 300 $SB --model $M/q06-bf16 --dtype bfloat16 --max-tokens $MT --concurrency 1,8,32 --repeats 2 \
  --agent-turns 3 --system-words 1500 --joiner-words 3000 --exit-streams 8 --ours-args "--shutdown-timeout 10" \
  --restart-words 1100 --out "$RES/sb-q06-bf16.json" --plots "$RES"
# A/B: our server with group prefill off (the default on a GPU is on)
step 60 $SB --model $M/q06-bf16 --dtype bfloat16 --max-tokens $MT --concurrency 8,32 --repeats 2 --only ours \
  --agent-turns 0 --joiner-words 0 --no-abort --exit-streams 0 --ours-args "--group-prefill off" \
  --out "$RES/sb-q06-bf16-nogroup.json"
# A/B: solo prefill right-padded to a multiple of 64 (opt-in; the default keeps exact widths)
step 60 $SB --model $M/q06-bf16 --dtype bfloat16 --max-tokens $MT --concurrency 8,32 --repeats 2 --only ours \
  --agent-turns 3 --system-words 1500 --joiner-words 0 --no-abort --exit-streams 0 --ours-args "--prefill-bucket 64" \
  --out "$RES/sb-q06-bf16-bucket64.json"
pack

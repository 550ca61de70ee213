#!/bin/bash
# KV quantization on a GPU (8B bf16 shape): KV bytes per row and max safe context for off/8/4, then
# c=8 streams of ~16k-token prompts through our server with --kv-quant off/8/4 and mlx_lm.server
# for reference (no batched KV quantization there). OUT=/tmp/out bash benchmarks/gpu_kv_quant.sh
# (KVS="8 4" picks the ours runs, SKIP_BYTES=1 and NO_MLX_LM=1 skip those steps: split across calls)
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/res-kv; M=${MODELS:-/tmp/models}; mkdir -p $OUT $M $R
SHAPE=${SHAPE:-llama3-8b}; D=${D:-l8-bf16}
pack() { tar czf $OUT/kv.tgz -C /tmp res-kv; cp $R/log.txt $OUT/kv-log.txt; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpu.txt 2>&1
echo "== $(date +%T) synth" > $R/log.txt
[ -d $M/$D ] || timeout 90 python3 benchmarks/synth_fast.py $M/$D $SHAPE bfloat16 none >> $R/log.txt 2>&1
if [ -z "${SKIP_BYTES:-}" ]; then
  echo "== $(date +%T) bytes" >> $R/log.txt
  timeout 120 python3 benchmarks/kv_quant_bytes.py --model $M/$D --tokens ${TOKENS:-16384} --out $R/bytes.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; pack
fi
# A server whose benchmark hit the time limit keeps its GPU memory: end it before the next run.
reap() { pkill -9 -f "actors.serve" 2>/dev/null; pkill -9 -f "mlx_lm server" 2>/dev/null; sleep 2; }
SB="python3 benchmarks/serve_bench.py --model $M/$D --dtype bfloat16 --max-tokens 128 --prompt-words ${WORDS:-4300} --concurrency 8 --repeats 1 --agent-turns 0 --joiner-words 0 --exit-streams 0 --no-abort --no-flags"
for kv in ${KVS-off 8 4}; do
  echo "== $(date +%T) ours kv=$kv" >> $R/log.txt
  timeout ${LIMIT:-150} $SB --only ours --ours-args "--kv-quant $kv" --out $R/ours-kv$kv.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; reap; pack
done
[ -n "${NO_MLX_LM:-}" ] && exit 0
echo "== $(date +%T) mlx_lm" >> $R/log.txt
timeout ${LIMIT:-150} $SB --only mlx_lm --out $R/mlx-lm.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; pack

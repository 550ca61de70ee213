#!/bin/bash
# One MoE shape on a GPU (Qwen3-30B-A3B-like, random weights, q4): c=1/8/32 through HTTP, ours
# vs mlx_lm.server, both with no flags, best of 2. OUT=/tmp/out bash benchmarks/gpu_moe.sh
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/res-moe; M=${MODELS:-/tmp/models}; mkdir -p $OUT $M $R
pack() { tar czf $OUT/moe.tgz -C /tmp res-moe; cp $R/log.txt $OUT/moe-log.txt; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpu.txt 2>&1
echo "== $(date +%T) synth" > $R/log.txt
[ -d $M/moe-q4 ] || timeout 150 python3 benchmarks/synth_fast.py $M/moe-q4 qwen3-30b-a3b bfloat16 q4 >> $R/log.txt 2>&1
echo "== $(date +%T) serve_bench" >> $R/log.txt
timeout ${LIMIT:-400} python3 benchmarks/serve_bench.py --model $M/moe-q4 --dtype bfloat16 --max-tokens ${MT:-64} \
  --concurrency 1,8,32 --repeats 2 --agent-turns 0 --joiner-words 0 --exit-streams 0 --no-abort --no-flags \
  --out $R/moe.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; pack

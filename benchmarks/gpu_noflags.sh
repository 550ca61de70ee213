#!/bin/bash
# Out of the box on a GPU: both servers with no flags (serve_bench --no-flags), 0.6B and 8B bf16 shapes,
# c=1/8/32. OUT=/tmp/out bash benchmarks/gpu_noflags.sh (needs mlx CUDA + mlx-lm importable).
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/res; M=/tmp/models; mkdir -p $OUT; mkdir -p $M $R
pack() { tar czf $OUT/all.tgz -C /tmp res; cp $R/log.txt $OUT/log.txt; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt 2>&1
python3 -c "import mlx.core as mx; print(mx.__version__, mx.device_info())" >> $R/gpu.txt 2>&1
echo "== synth $(date +%T)" > $R/log.txt
timeout 40 python3 benchmarks/synth_fast.py $M/q06-bf16 qwen3-0.6b bfloat16 none >> $R/log.txt 2>&1
SB="--dtype bfloat16 --max-tokens 128 --concurrency 1,8,32 --repeats 2 --agent-turns 0 --joiner-words 0 --exit-streams 0 --no-flags"
echo "== side q06 $(date +%T)" >> $R/log.txt
timeout 170 python3 benchmarks/serve_bench.py --model $M/q06-bf16 $SB --abort --out $R/side-q06-bf16.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; pack
timeout 90 python3 benchmarks/synth_fast.py $M/l8-bf16 llama3-8b bfloat16 none >> $R/log.txt 2>&1
echo "== side l8 $(date +%T)" >> $R/log.txt
timeout 230 python3 benchmarks/serve_bench.py --model $M/l8-bf16 $SB --no-abort --out $R/side-l8-bf16.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; pack

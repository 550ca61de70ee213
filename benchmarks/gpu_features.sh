#!/bin/bash
# The GPU must-shows of KV quantization, speculative decoding and LoRA in one call (8B bf16 shape):
# benchmarks/gpu_kv_quant.sh, benchmarks/gpu_spec.sh, then benchmarks/lora_bench.py. OUT=/tmp/out bash benchmarks/gpu_features.sh
set -u
OUT=${OUT:-/tmp/out}; M=${MODELS:-/tmp/models}; mkdir -p $OUT $M /tmp/res-lora
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=$OUT MODELS=$M bash benchmarks/gpu_kv_quant.sh
OUT=$OUT MODELS=$M bash benchmarks/gpu_spec.sh
echo "== $(date +%T) lora" > /tmp/res-lora/log.txt
timeout ${LIMIT:-150} python3 benchmarks/lora_bench.py --model $M/${D:-l8-bf16} --rank 16 --rows 8 --steps 128 --out /tmp/res-lora/lora.json >> /tmp/res-lora/log.txt 2>&1
echo "rc=$?" >> /tmp/res-lora/log.txt; cp /tmp/res-lora/* $OUT/ 2>/dev/null

#!/bin/bash
# LoRA decode on a GPU (8B bf16 shape, 8 rows): base-only vs one adapter vs four, interleaved
# rounds, bf16 and float32 adapters; first the kernels' tests (engine tests included: they take
# the kernels on CUDA) and the deltas alone. OUT=/tmp/out bash benchmarks/gpu_lora.sh
set -u
OUT=${OUT:-/tmp/out}; M=${MODELS:-/tmp/models}; mkdir -p $OUT $M
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/lora-gpu.txt 2>&1
# The kernels' own checks and the engine's adapter tests (pytest wheels needed; give them 200 s).
timeout ${TEST_LIMIT:-90} python3 -m pytest -q -rf --tb=line -p no:cacheprovider tests/model/test_lora_kernel.py tests/model/test_engine_lora.py > $OUT/lora-tests.txt 2>&1
tail -4 $OUT/lora-tests.txt
# The deltas alone, 32 layers of the 8B shape, compiled (MICRO=0 skips).
[ "${MICRO:-1}" = 1 ] && timeout 120 python3 benchmarks/lora_delta_micro.py > $OUT/lora-micro.txt 2>&1; tail -6 $OUT/lora-micro.txt
[ -d $M/l8-bf16 ] || timeout 90 python3 benchmarks/synth_fast.py $M/l8-bf16 llama3-8b bfloat16 none > $OUT/lora-synth.txt 2>&1
# Two adapter shapes: rank 16 on every linear of every block (the heavy case), and mlx_lm.lora's
# defaults (rank 8 on the last 16 blocks); SHAPES=heavy runs the first only.
for shape in ${SHAPES:-heavy default}; do
  case $shape in heavy) set -- 16 -1 heavy ;; *) set -- 8 16 default ;; esac
  timeout ${LIMIT:-300} python3 benchmarks/lora_bench.py --model $M/l8-bf16 --rank $1 --num-layers $2 --rows 8 \
    --steps ${STEPS:-96} --rounds ${ROUNDS:-3} --adapter-dtypes ${DTYPES:-model,float32} \
    --out $OUT/lora-$3.json > $OUT/lora-$3.txt 2>&1
  echo "rc=$?" >> $OUT/lora-$3.txt
  tail -12 $OUT/lora-$3.txt
done

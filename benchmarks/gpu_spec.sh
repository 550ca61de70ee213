#!/bin/bash
# Speculative decoding on a GPU, B=1: the 8B bf16 shape as target and a 0.6B-shape draft (random
# weights: it accepts nothing, so the target as its own draft and n-gram lookup show the rest):
# verification cost at K=1..8 and end to end (benchmarks/spec_bench.py), then c=1 through HTTP,
# ours with --draft-model vs mlx_lm.server with the same draft. OUT=/tmp/out bash benchmarks/gpu_spec.sh
set -u
OUT=${OUT:-/tmp/out}; R=/tmp/res-spec; M=${MODELS:-/tmp/models}; mkdir -p $OUT $M $R
SHAPE=${SHAPE:-llama3-8b}; D=${D:-l8-bf16}; DRAFT_SHAPE=${DRAFT_SHAPE:-qwen3-0.6b}
pack() { tar czf $OUT/spec.tgz -C /tmp res-spec; cp $R/log.txt $OUT/spec-log.txt; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv > $R/gpu.txt 2>&1
echo "== $(date +%T) synth" > $R/log.txt
[ -d $M/$D ] || timeout 90 python3 benchmarks/synth_fast.py $M/$D $SHAPE bfloat16 none >> $R/log.txt 2>&1
[ -d $M/draft ] || timeout 60 python3 -c "
import sys; sys.path.insert(0, 'benchmarks'); sys.path.insert(0, '.')
from synth_fast import SHAPES, fast_model_dir
vocab = SHAPES['$SHAPE'].get('vocab_size')
fast_model_dir('$M/draft', dtype='bfloat16', quant=None, **{**SHAPES['$DRAFT_SHAPE'], **({'vocab_size': vocab} if vocab else {})})
" >> $R/log.txt 2>&1
echo "== $(date +%T) spec_bench" >> $R/log.txt
timeout ${LIMIT:-200} python3 benchmarks/spec_bench.py --model $M/$D --draft $M/draft --prompt-tokens 512 --max-tokens ${MT:-256} --out $R/spec.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; pack
SB="python3 benchmarks/serve_bench.py --model $M/$D --dtype bfloat16 --max-tokens ${MT:-256} --prompt-words ${WORDS:-135} --concurrency 1 --repeats 2 --agent-turns 0 --joiner-words 0 --exit-streams 0 --no-abort --no-flags"
echo "== $(date +%T) http c=1" >> $R/log.txt
timeout ${LIMIT:-200} $SB --ours-args "--draft-model $M/draft" --mlx-lm-args "--draft-model $M/draft --num-draft-tokens 3" --out $R/http-draft.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; pack

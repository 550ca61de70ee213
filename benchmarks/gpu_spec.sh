#!/bin/bash
# Speculative decoding on a GPU, B=1, 8B bf16 shape as target and a 0.6B-shape draft (same vocab,
# untied). Random weights accept nothing, so both are rewritten by benchmarks/cyclic_model.py into
# models whose greedy output is one fixed cycle (full size and cost, every draft right):
# verification cost at K=1..8 and end to end (benchmarks/spec_bench.py: plain, the target as its
# own draft, the 0.6B draft, n-gram K=3 and 8), then c=1 through HTTP: both servers plain, both
# with the same draft, ours with n-gram. OUT=/tmp/out bash benchmarks/gpu_spec.sh
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
fast_model_dir('$M/draft', dtype='bfloat16', quant=None, **{**SHAPES['$DRAFT_SHAPE'], 'tie_word_embeddings': False, **({'vocab_size': vocab} if vocab else {})})
" >> $R/log.txt 2>&1
echo "== $(date +%T) cyclic" >> $R/log.txt
[ -d $M/cyc ] || timeout 120 python3 benchmarks/cyclic_model.py $M/$D $M/cyc >> $R/log.txt 2>&1
[ -d $M/cyc-draft ] || timeout 60 python3 benchmarks/cyclic_model.py $M/draft $M/cyc-draft >> $R/log.txt 2>&1
echo "== $(date +%T) spec_bench" >> $R/log.txt
timeout ${LIMIT:-150} python3 benchmarks/spec_bench.py --model $M/cyc --draft $M/cyc-draft --prompt-tokens 512 --max-tokens ${MT:-256} --reps 10 --out $R/spec.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; pack
SB="python3 benchmarks/serve_bench.py --model $M/cyc --dtype bfloat16 --max-tokens ${MT:-256} --prompt-words ${WORDS:-135} --concurrency 1 --repeats 2 --agent-turns 0 --joiner-words 0 --exit-streams 0 --no-abort --no-flags"
echo "== $(date +%T) http c=1 plain" >> $R/log.txt
timeout ${LIMIT:-150} $SB --out $R/http-plain.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; pack
echo "== $(date +%T) http c=1 draft" >> $R/log.txt
timeout ${LIMIT:-150} $SB --ours-args "--draft-model $M/cyc-draft" --mlx-lm-args "--draft-model $M/cyc-draft --num-draft-tokens 3" --out $R/http-draft.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; pack
echo "== $(date +%T) http c=1 ngram (ours)" >> $R/log.txt
timeout ${LIMIT:-150} $SB --only ours --ours-args "--draft-kind ngram" --out $R/http-ngram.json >> $R/log.txt 2>&1; echo "rc=$?" >> $R/log.txt; pack

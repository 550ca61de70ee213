#!/bin/bash
# Memory under load on a CUDA GPU (actors/kv_memory.py), steps in the order given, each bounded, the
# whole run ending by DEADLINE seconds (default 560); results in $OUT/mem.tgz and $OUT/mem-log.txt:
#   q4      8B q4 shape, no flags: GPU memory at ready, after a c=32 burst, after 10 s idle, ours vs mlx_lm.server
#   bf16    the same on the 8B bf16 shape (its 32k-window copy: the window changes no burst cost)
#   agents  8B bf16 shape, 32k window: 32 concurrent agents of ~19k-token prompts (their KV passes
#           the budget): every request's outcome, aggregate tok/s, our preemptions; then mlx_lm.server
#   quant   the CUDA kernel tests of model/quant_kernel.py (benchmarks/gpu_quant.sh tests)
# OUT=/tmp/out bash benchmarks/gpu_kv_memory.sh q4 quant agents
set -u
OUT=${OUT:-/tmp/out}; M=${MODELS:-/tmp/models}; R=/tmp/res-mem; mkdir -p $OUT $M $R
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s); DEADLINE=${DEADLINE:-560}
cleanup() { pkill -INT -f "actors.serve|mlx_lm" 2>/dev/null; sleep 3; pkill -KILL -f "actors.serve|mlx_lm" 2>/dev/null; }
trap cleanup EXIT
log() { echo "== $(date +%T) +$(( $(date +%s) - T0 ))s $*" | tee -a $OUT/mem-log.txt; }
pack() { tar czf $OUT/mem.tgz -C /tmp res-mem; }
lim() {
  local left=$(( DEADLINE - ($(date +%s) - T0) - 15 )); local s=$1; shift
  [ $left -lt $s ] && s=$left; [ $s -lt 5 ] && { log "skipped: no time left"; return 124; }
  timeout -s INT -k 15 $s "$@"
}
synth_32k() {  # the 8B bf16 shape with a 32k window (the memory and isolate benchmarks' model)
  [ -d $M/l8-32k ] || { log "synth l8-32k"; lim 120 python3 -c "
import sys; sys.path.insert(0, '.')
from benchmarks.synth_fast import SHAPES, fast_model_dir
fast_model_dir('$M/l8-32k', dtype='bfloat16', quant=None, **{**SHAPES['llama3-8b'], 'max_position_embeddings': 32768})
" >> $R/synth.txt 2>&1; }
}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee -a $OUT/mem-log.txt
for step in ${@:-q4 agents}; do
  case $step in
    q4)
      [ -d $M/l8-q4 ] || { log "synth l8-q4"; lim 120 python3 benchmarks/synth_fast.py $M/l8-q4 llama3-8b bfloat16 q4 > $R/synth.txt 2>&1; }
      log q4
      lim 200 python3 benchmarks/kv_memory_bench.py --model $M/l8-q4 --burst 32 --prompt-words 135 --max-tokens 256 \
        --limit 60 --out $R/mem-l8-q4.json > $R/mem-l8-q4.txt 2>&1
      cleanup; pack; cat $R/mem-l8-q4.txt | cut -c1-1500 >> $OUT/mem-log.txt ;;
    bf16)
      synth_32k
      log bf16
      lim 200 python3 benchmarks/kv_memory_bench.py --model $M/l8-32k --burst 32 --prompt-words 135 --max-tokens 256 \
        --limit 60 --out $R/mem-l8-bf16.json > $R/mem-l8-bf16.txt 2>&1
      cleanup; pack; cat $R/mem-l8-bf16.txt | cut -c1-1500 >> $OUT/mem-log.txt ;;
    agents)
      synth_32k
      log agents
      lim 330 python3 benchmarks/kv_memory_bench.py --model $M/l8-32k --burst 32 --prompt-words 5000 --max-tokens 256 \
        --limit 150 --idle 3 --out $R/agents-l8-32k.json > $R/agents.txt 2>&1
      cleanup; pack; cat $R/agents.txt | cut -c1-2500 >> $OUT/mem-log.txt ;;
    quant)
      log quant
      lim 150 python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
        tests/model/test_quant_kernel.py tests/model/test_kv_quant_kernel.py > $R/quant-tests.txt 2>&1
      pack; grep -E "passed|failed|FAILED|Error" $R/quant-tests.txt | tail -30 >> $OUT/mem-log.txt ;;
  esac
done
log done

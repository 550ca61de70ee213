#!/bin/bash
# --isolate on a CUDA GPU: our server with the engine in a child process vs in process, 8B bf16
# shape, no other flags, c=1/8/32, ~512-token prompts, 128 tokens; ROUNDS alternating pairs
# (default 3), each run bounded, the whole ending by DEADLINE seconds (default 300). Results in
# $OUT/isolate.tgz (serve_bench JSONs) and $OUT/isolate-log.txt.
# OUT=/tmp/out bash benchmarks/gpu_isolate.sh
set -u
OUT=${OUT:-/tmp/out}; M=${MODELS:-/tmp/models}; R=/tmp/res-isolate; mkdir -p $OUT $M $R
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s); DEADLINE=${DEADLINE:-300}
cleanup() { pkill -INT -f "actors.serve|actors.isolate|mlx_lm" 2>/dev/null; sleep 3; pkill -KILL -f "actors.serve|actors.isolate|mlx_lm" 2>/dev/null; }
trap cleanup EXIT
log() { echo "== $(date +%T) +$(( $(date +%s) - T0 ))s $*" | tee -a $OUT/isolate-log.txt; }
pack() { tar czf $OUT/isolate.tgz -C /tmp res-isolate; }
lim() {
  local left=$(( DEADLINE - ($(date +%s) - T0) - 15 )); local s=$1; shift
  [ $left -lt $s ] && s=$left; [ $s -lt 5 ] && { log "skipped: no time left"; return 124; }
  timeout -s INT -k 15 $s "$@"
}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $OUT/isolate-log.txt
# The same model the memory benchmark's long-context agents use (its 32k window changes no decode cost).
[ -d $M/l8-32k ] || { log "synth l8-32k"; lim 120 python3 -c "
import sys; sys.path.insert(0, '.')
from benchmarks.synth_fast import SHAPES, fast_model_dir
fast_model_dir('$M/l8-32k', dtype='bfloat16', quant=None, **{**SHAPES['llama3-8b'], 'max_position_embeddings': 32768})
" > $R/synth.txt 2>&1; }
SB="python3 benchmarks/serve_bench.py --model $M/l8-32k --dtype bfloat16 --only ours --max-tokens 128 --prompt-words 135
 --concurrency 1,8,32 --repeats 1 --agent-turns 0 --joiner-words 0 --exit-streams 0 --no-abort --no-flags"
for r in $(seq 1 ${ROUNDS:-3}); do
  log "plain r$r"; lim 110 $SB --out $R/plain-r$r.json > $R/plain-r$r.txt 2>&1; cleanup
  log "isolate r$r"; lim 110 $SB --ours-args=--isolate --out $R/isolate-r$r.json > $R/isolate-r$r.txt 2>&1; cleanup
  pack
done
python3 - $R >> $OUT/isolate-log.txt 2>&1 <<'PY'
import json, pathlib, sys
r = pathlib.Path(sys.argv[1])
for f in sorted(r.glob("*-r*.json")):
    ours = json.loads(f.read_text()).get("ours", {})
    cells = [f"c{c} {ours[k]['agg_tok_s']:.1f} tok/s itl50 {ours[k]['itl_p50'] * 1e3:.2f} ms"
             for c in (1, 8, 32) if isinstance(ours.get(k := f"c{c}"), dict)]
    print(f.name, "start", round(ours.get("start_s", 0), 1), "|", " | ".join(cells))
PY
log done

#!/bin/bash
# --paged-kv on a CUDA GPU: our server with a batch's KV in 256-position blocks (decode attention
# through model/kv/paged_kernel.py) vs the contiguous, left-padded batch, 8B bf16 shape, no other
# flags, c=1/8/32, ~512-token prompts (PROMPT_WORDS, default 135), 128 tokens; ROUNDS alternating
# pairs (default 2), each run bounded, the whole ending by DEADLINE seconds (default 300). The
# paged servers' logs are kept: the kernel's first-use verdict ("paged-KV decode attention kernel
# ... on/off") says whether decode read the blocks in place or gathered them. Results in
# $OUT/paged.tgz (serve_bench JSONs, server logs) and $OUT/paged-log.txt.
# OUT=/tmp/out bash benchmarks/gpu_paged.sh
set -u
OUT=${OUT:-/tmp/out}; M=${MODELS:-/tmp/models}; R=/tmp/res-paged; mkdir -p $OUT $M $R
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
T0=$(date +%s); DEADLINE=${DEADLINE:-300}
cleanup() { pkill -INT -f "actors.serve|mlx_lm" 2>/dev/null; sleep 3; pkill -KILL -f "actors.serve|mlx_lm" 2>/dev/null; }
trap cleanup EXIT
log() { echo "== $(date +%T) +$(( $(date +%s) - T0 ))s $*" | tee -a $OUT/paged-log.txt; }
pack() { tar czf $OUT/paged.tgz -C /tmp res-paged; }
lim() {
  local left=$(( DEADLINE - ($(date +%s) - T0) - 15 )); local s=$1; shift
  [ $left -lt $s ] && s=$left; [ $s -lt 5 ] && { log "skipped: no time left"; return 124; }
  timeout -s INT -k 15 $s "$@"
}
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $OUT/paged-log.txt
# The same model the isolate and memory benchmarks use (its 32k window changes no decode cost).
[ -d $M/l8-32k ] || { log "synth l8-32k"; lim 120 python3 -c "
import sys; sys.path.insert(0, '.')
from benchmarks.synth_fast import SHAPES, fast_model_dir
fast_model_dir('$M/l8-32k', dtype='bfloat16', quant=None, **{**SHAPES['llama3-8b'], 'max_position_embeddings': 32768})
" > $R/synth.txt 2>&1; }
SB="python3 benchmarks/serve_bench.py --model $M/l8-32k --dtype bfloat16 --only ours --max-tokens 128
 --prompt-words ${PROMPT_WORDS:-135} --concurrency 1,8,32 --repeats 1 --agent-turns 0 --joiner-words 0
 --exit-streams 0 --no-abort --no-flags"
for r in $(seq 1 ${ROUNDS:-2}); do
  log "contiguous r$r"; lim 110 $SB --out $R/contiguous-r$r.json > $R/contiguous-r$r.txt 2>&1; cleanup
  log "paged r$r"
  lim 110 $SB --ours-args=--paged-kv --server-logs $R/logs-paged-r$r --out $R/paged-r$r.json > $R/paged-r$r.txt 2>&1
  cleanup
  grep -h "paged-KV decode attention kernel" $R/logs-paged-r$r/*.log 2>/dev/null | tee -a $OUT/paged-log.txt
  pack
done
python3 - $R >> $OUT/paged-log.txt 2>&1 <<'PY'
import json, pathlib, sys
r = pathlib.Path(sys.argv[1])
for f in sorted(r.glob("*-r*.json")):
    ours = json.loads(f.read_text()).get("ours", {})
    cells = []
    for c in (1, 8, 32):
        cell = ours.get(f"c{c}")
        if isinstance(cell, dict):
            steady = cell.get("steady_tok_s")
            cells.append(
                f"c{c} {cell['agg_tok_s']:.1f} tok/s"
                + (f" steady {steady:.1f}" if steady else "")
                + f" itl50 {cell['itl_p50'] * 1e3:.2f} ms"
            )
    print(f.name, "start", round(ours.get("start_s", 0), 1), "|", " | ".join(cells))
PY
log done

#!/bin/bash
# The model pool on a CUDA GPU (issue 47): benchmarks/pool_switch.py on two 8B q4-shape models A and
# B (symlinks to one synth l8-q4; B's config.json its own, so its own SSD tier):
#   switching  --model-pool 1 --ssd-cache: A's first request (load + cold 4k prefill), cold and hot
#              4k TTFT with A resident, A -> B switch, B -> A warm return (4k prompt from the SSD
#              tier: cached_tokens) and cold return (a fresh 4k prompt)
#   throughput --model-pool 2: aggregate tok/s of c=8 greedy streams (256 tokens) all on A vs 4 on A + 4 on B
# About 2-3 minutes on an H100 with l8-q4 already in $MODELS, ~40 s more to synth it. Results in
# $OUT/pool.tgz (res-pool: pool.json, pool.txt, gpu.txt), the table in $OUT/pool-log.txt.
# OUT=/tmp/out bash benchmarks/gpu_pool.sh
set -u
OUT=${OUT:-/tmp/out}; M=${MODELS:-/tmp/models}; R=/tmp/res-pool; W=/tmp/pool-work; mkdir -p $OUT $M $R
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Everything ends by DEADLINE seconds after the start (default 290: a ~300 s device call).
T0=$(date +%s); DEADLINE=${DEADLINE:-290}
PIDS=$R/server-pids; : > $PIDS
log() { echo "== $(date +%T) +$(( $(date +%s) - T0 ))s $*" | tee -a $OUT/pool-log.txt; }
pack() { tar czf $OUT/pool.tgz -C /tmp res-pool; }
lim() {  # lim SECONDS cmd...: at most SECONDS, and never past the deadline
  local left=$(( DEADLINE - ($(date +%s) - T0) - 15 )); local s=$1; shift
  [ $left -lt $s ] && s=$left; [ $s -lt 5 ] && { log "skipped: no time left"; return 124; }
  timeout -s INT -k 15 $s "$@"
}
cleanup() {  # the servers pool_switch.py started (their pids in $PIDS) and nothing else, then pack
  local p
  for p in $(cat $PIDS 2>/dev/null); do grep -qs actors.serve /proc/$p/cmdline && kill -INT $p 2>/dev/null; done
  sleep 2
  for p in $(cat $PIDS 2>/dev/null); do grep -qs actors.serve /proc/$p/cmdline && kill -KILL $p 2>/dev/null; done
  rm -rf $W; pack
}
trap cleanup EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1
cat $R/gpu.txt >> $OUT/pool-log.txt
[ -d $M/l8-q4 ] || { log "synth l8-q4"; lim ${SYNTH_LIMIT:-120} python3 benchmarks/synth_fast.py $M/l8-q4 llama3-8b bfloat16 q4 > $R/synth.txt 2>&1; tail -2 $R/synth.txt >> $OUT/pool-log.txt; }
log pool
rm -rf $W
lim ${POOL_LIMIT:-260} python3 benchmarks/pool_switch.py --model $M/l8-q4 --prompt-tokens ${PROMPT_TOKENS:-4096} \
  --concurrency ${C:-8} --c-prompt-tokens ${C_PROMPT:-512} --c-max-tokens ${C_TOKENS:-256} --repeats ${REPEATS:-2} \
  --work-dir $W --pid-file $PIDS --out $R/pool.json ${POOL_ARGS:-} > $R/pool-stdout.txt 2> $R/pool.txt
echo "rc=$?" >> $R/pool.txt
pack; grep -E "^(\||pool: |switching|throughput|rc=|Traceback|[A-Za-z]*(Error|Interrupt))" $R/pool.txt | cut -c1-400 | tee -a $OUT/pool-log.txt
log done

#!/bin/bash
# Quantized models on a CUDA GPU (model/quant_kernel.py, model/kv/quant_kernel.py): the kernels'
# tests, the products alone, and both servers with no flags. Steps run in the order given
# (default: all), each with its own time limit, results under $OUT as they finish:
#   diag    benchmarks/quant_diag.py (<100 s: MLX's CUTLASS kernels compile at first use, ~20 s each):
#           8B q4 shapes at 1/8/32 rows, MLX's op (as [rows, K] and as [rows, 1, K]) vs our kernel,
#           first-call (compile) times, and which one the routing picks after its load-time check
#   tests   every kernel's call sites compiled as the server builds them (tests/model/test_cuda_build.py),
#           then the CUDA-only kernel tests (dense, routed experts, quantized-KV attention; ~90 s)
#   micro   benchmarks/quant_micro.py: dense 8B shapes (tilings searched at 4 bits), MoE, KV
#   serve8b 8B q4 shape, ours vs mlx_lm.server, c=1/8/32, ~512-token prompts (135 words), 256 tokens
#   parity  greedy tokens of q4 and q8 models through our server vs mlx_lm generate_step
#   kv      16k-token prompts, c=8, our server --kv-quant off / 8 / 4 (on the 8B q4 model); compare
#           "steady_tok_s" (all 8 streams decoding, after the last prefill), not the prefill-bound total
#   moe     Qwen3-30B-A3B q4 shape, ours vs mlx_lm.server, c=8/32
# Every server's own log is kept under res-quant/logs (its start-up line says which products take
# the kernels: model/quant_linear.py); that line is copied into quant-log.txt.
# OUT=/tmp/out bash benchmarks/gpu_quant.sh diag tests serve8b parity
set -u
# Everything lands in /tmp/res-quant, packed into $OUT/quant.tgz after each step ($OUT/quant-log.txt:
# the steps' tails). A step past its limit gets SIGINT (serve_bench then stops its servers), then
# SIGKILL 20 s later.
OUT=${OUT:-/tmp/out}; M=${MODELS:-/tmp/models}; R=/tmp/res-quant; mkdir -p $OUT $M $R
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1
grep -q H200 $R/gpu.txt && BW=${BW:-4800} || BW=${BW:-3350}  # GB/s for the rooflines (H100 SXM / H200)
# Every step ends by DEADLINE seconds after the start (default 570: a device call's 600 s less the packing).
T0=$(date +%s); DEADLINE=${DEADLINE:-570}
log() { echo "== $(date +%T) +$(( $(date +%s) - T0 ))s $*" | tee -a $OUT/quant-log.txt; }
pack() { tar czf $OUT/quant.tgz -C /tmp res-quant; }
lim() {  # lim SECONDS cmd...: at most SECONDS, and never past the deadline
  local left=$(( DEADLINE - ($(date +%s) - T0) - 25 )); local s=$1; shift
  [ $left -lt $s ] && s=$left; [ $s -lt 5 ] && { echo "skipped: no time left" ; return 124; }
  timeout -s INT -k 20 $s "$@"
}
cat $R/gpu.txt >> $OUT/quant-log.txt
SB="python3 benchmarks/serve_bench.py --dtype bfloat16 --agent-turns 0 --joiner-words 0 --exit-streams 0 --no-abort --no-flags --server-logs $R/logs"
routing() {  # the routing lines of the servers' logs so far, into the step log
  grep -h "quantized products\|decode attention kernel\|our CUDA kernels\|batch prefill through quantized" $R/logs/ours-*.log 2>/dev/null | sort -u | tail -${1:-6} | cut -c1-3000 >> $OUT/quant-log.txt
}
synth() {  # synth DIR SHAPE QUANT [LAYERS]
  [ -d $M/$1 ] || { log "synth $1"; lim ${SYNTH_LIMIT:-150} python3 benchmarks/synth_fast.py $M/$1 $2 bfloat16 $3 ${4:-} >> $R/synth.txt 2>&1; }
}
for step in ${@:-diag tests micro serve8b parity kv moe}; do
  case $step in
    diag)
      log diag
      lim ${DIAG_LIMIT:-100} python3 benchmarks/quant_diag.py --budget ${DIAG_BUDGET:-70} --rows ${DIAG_ROWS:-1,8,32,2048} > $R/diag.txt 2>&1
      echo "rc=$?" >> $R/diag.txt; pack; cut -c1-1500 $R/diag.txt | tail -40 >> $OUT/quant-log.txt ;;
    tests)
      # -v names each test as it starts; a test stuck past 45 s gets every thread's stack dumped.
      log tests
      # every kernel's call sites through NVRTC as the server builds them (model/kernels/cuda_build.py)
      lim 60 python3 -m pytest -v -rf --tb=short -p no:cacheprovider -m slow tests/model/test_cuda_build.py > $R/tests.txt 2>&1
      echo "rc=$?" >> $R/tests.txt
      lim ${TEST_LIMIT:-150} python3 -m pytest -v -rf --tb=short -p no:cacheprovider --durations=12 \
        -o faulthandler_timeout=45 tests/model/test_quant_kernel.py tests/model/test_kv_quant_kernel.py >> $R/tests.txt 2>&1
      echo "rc=$?" >> $R/tests.txt
      pack; grep -E "passed|failed|FAILED|Error|Timeout|cuda kernels|^[0-9.]+s (call|setup)|rc=" $R/tests.txt | tail -40 \
        | cut -c1-600 | tee -a $OUT/quant-log.txt ;;
    micro)
      log micro
      lim ${MICRO_LIMIT:-150} python3 benchmarks/quant_micro.py --bandwidth-gbs $BW ${MICRO_ARGS:---bits 4 --search --moe --kv} \
        --out $R/micro-q4.json > $R/micro.txt 2>&1
      [ -n "${MICRO_Q8-1}" ] && lim 60 python3 benchmarks/quant_micro.py --bandwidth-gbs $BW --bits 8 --out $R/micro-q8.json >> $R/micro.txt 2>&1
      pack; grep -v "^ \|^{\|^}" $R/micro.txt >> $OUT/quant-log.txt ;;
    serve8b)
      synth l8-q4 llama3-8b q4
      log serve8b
      lim ${SERVE_LIMIT:-300} $SB --model $M/l8-q4 --max-tokens 256 --prompt-words ${WORDS:-135} --concurrency 1,8,32 \
        --repeats 1 --out $R/serve-l8-q4.json > $R/serve-l8-q4.txt 2>&1
      echo "rc=$?" >> $R/serve-l8-q4.txt; pack; tail -14 $R/serve-l8-q4.txt >> $OUT/quant-log.txt; routing 4 ;;
    parity)
      synth q06-q4 qwen3-0.6b q4; synth q06-q8 qwen3-0.6b q8
      log parity
      lim ${PARITY_LIMIT:-200} python3 benchmarks/quant_parity.py --model $M/q06-q4 --model $M/q06-q8 \
        --tokens 48 --prompts 4 --out $R/parity.json --server-logs $R/logs > $R/parity.txt 2>&1
      echo "rc=$?" >> $R/parity.txt; pack; grep -v "^ \|^{\|^}" $R/parity.txt | tail -8 | cut -c1-1500 >> $OUT/quant-log.txt ;;
    kv)
      synth l8-q4 llama3-8b q4
      for kv in off 8 4; do
        log "kv $kv"
        lim ${KV_LIMIT:-150} $SB --model $M/l8-q4 --max-tokens ${KV_TOKENS:-384} --prompt-words ${KV_WORDS:-4300} --concurrency 8 \
          --repeats 1 --only ours --ours-args "--kv-quant $kv" --out $R/kv$kv.json > $R/kv$kv.txt 2>&1
        echo "rc=$?" >> $R/kv$kv.txt; pack
        grep -o '"steady_tok_s[^,]*,[^,]*,\|"agg_tok_s[^,]*\|"ttft_p50[^,]*' $R/kv$kv.json | tr '\n' ' ' >> $OUT/quant-log.txt
        tail -2 $R/kv$kv.txt >> $OUT/quant-log.txt
      done ;;
    moe)
      synth moe-q4 qwen3-30b-a3b q4 ${MOE_LAYERS:-}
      log moe
      lim ${MOE_LIMIT:-300} $SB --model $M/moe-q4 --max-tokens ${MOE_TOKENS:-128} --concurrency ${MOE_C:-8,32} \
        --repeats 1 --out $R/moe.json > $R/moe.txt 2>&1
      echo "rc=$?" >> $R/moe.txt; pack; tail -12 $R/moe.txt >> $OUT/quant-log.txt; routing 4 ;;
  esac
done
log done

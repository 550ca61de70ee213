#!/bin/bash
# Issue 51's GPU figure: TTFT of a 10 s 1280x720 video (Qwen3.5-0.8B shape with its vision tower) and
# of a 30 s 16 kHz audio clip (Gemma 4 E2B shape with its audio tower), each with a ~100-token
# question, cold (a clip the server has not seen, kernels warm) and cached (the same request again),
# through our server's OpenAI chat API (benchmarks/media_ttft.py: random bf16 weights at the real
# shapes, written here; the clips made here). Steps in the order given (default: check video audio),
# each with its own limit, results under $OUT as they finish:
#   check  what imports (mlx on the GPU, PyAV with libx264, Pillow, prometheus_client)
#   video  Qwen3.5-0.8B: synth (~2 GB), 3 clips, the server, ~9000-token prompts (8800 video tokens)
#   audio  Gemma 4 E2B: synth (~11 GB), 3 clips, the server, ~870-token prompts (750 audio tokens)
# Expected on one H100: ~2.5-3 minutes in all (first requests compile kernels). Results in
# $OUT/media.tgz (res-media: video.json, audio.json, their stderr, gpu.txt), the tables in
# $OUT/media-log.txt.
#
# PyAV: the server decodes video and audio with it (model/vision/video.py, model/audio/decode.py);
# the GPU image has Pillow and prometheus_client but no `av`, and ../shared/gpu/prepare.sh does not
# stage it. Its wheel (36.6 MB; FFmpeg and libx264 inside, no dependencies) lies in .gpu/media/
# (git-ignored), fetched here with
#   pip download av==18.1.1 --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .gpu/media
# On the device, after the usual staging of .gpu/a and .gpu/b (PYTHONPATH=$PWD:$HOME/site), one call
# with carry [".gpu/media"] (the tree ~17 MB + the wheel fits the 64 MiB) and timeout_s 300:
#   export PYTHONPATH=$PWD:$HOME/site; OUT=$OUT bash benchmarks/gpu_media.sh
# installs it itself (pip install --no-index --no-deps --target $HOME/site .gpu/media/*.whl) when
# `av` does not import; or install it in a call of its own first and run this without the carry.
# Knobs: DEADLINE (290 s), VIDEO_LIMIT / AUDIO_LIMIT (150 / 170 s), MEDIA_ARGS (more flags for
# media_ttft.py, e.g. "--repeats 3"), MODELS (/tmp/models; a checkpoint of the same shape is reused).
# CPU smoke run: DEADLINE=1200 VIDEO_LIMIT=600 AUDIO_LIMIT=600 MEDIA_ARGS="--dtype float32 --text-layers 4 \
#   --vision-depth 1 --audio-layers 2 --video-seconds 2 --video-size 640x360" OUT=/tmp/mo bash benchmarks/gpu_media.sh
set -u
OUT=${OUT:-/tmp/out}; M=${MODELS:-/tmp/models}; R=/tmp/res-media; mkdir -p $OUT $M $R
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Everything ends by DEADLINE seconds after the start (default 290: a ~300 s device call).
T0=$(date +%s); DEADLINE=${DEADLINE:-290}
PIDS=$R/server-pids; : > $PIDS
log() { echo "== $(date +%T) +$(( $(date +%s) - T0 ))s $*" | tee -a $OUT/media-log.txt; }
pack() { tar czf $OUT/media.tgz -C /tmp res-media; }
lim() {  # lim SECONDS cmd...: at most SECONDS, and never past the deadline
  local left=$(( DEADLINE - ($(date +%s) - T0) - 15 )); local s=$1; shift
  [ $left -lt $s ] && s=$left; [ $s -lt 5 ] && { log "skipped: no time left"; return 124; }
  timeout -s INT -k 15 $s "$@"
}
cleanup() {  # the servers media_ttft.py started (their pids in $PIDS) and nothing else, then pack
  local p
  for p in $(cat $PIDS 2>/dev/null); do grep -qs actors.serve /proc/$p/cmdline && kill -INT $p 2>/dev/null; done
  sleep 2
  for p in $(cat $PIDS 2>/dev/null); do grep -qs actors.serve /proc/$p/cmdline && kill -KILL $p 2>/dev/null; done
  pack
}
trap cleanup EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt 2>&1
cat $R/gpu.txt >> $OUT/media-log.txt
if ! python3 -c "import av" 2>/dev/null && ls .gpu/media/av-*.whl >/dev/null 2>&1; then
  log "installing .gpu/media/*.whl into $HOME/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $HOME/site .gpu/media/*.whl \
    >> $R/pip.txt 2>&1
  tail -3 $R/pip.txt >> $OUT/media-log.txt
  case ":${PYTHONPATH:-}:" in *":$HOME/site:"*) ;; *) export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$HOME/site ;; esac
fi
MT="python3 benchmarks/media_ttft.py --model-root $M --pid-file $PIDS ${MEDIA_ARGS:-}"
for step in ${@:-check video audio}; do
  case $step in
    check)
      log check
      lim 60 python3 -c "
import platform, mlx.core as mx, av, PIL, prometheus_client
print('python', platform.python_version(), 'mlx', mx.__version__, mx.default_device(), 'av', av.__version__, 'pillow', PIL.__version__)
try:
    av.codec.Codec('libx264', 'w'); print('libx264: yes')
except Exception as e:
    print('libx264: no (clips fall back to mpeg4):', e)
" > $R/check.txt 2>&1 || { cat $R/check.txt >> $OUT/media-log.txt; log "check failed: stopping"; exit 1; }
      cat $R/check.txt >> $OUT/media-log.txt ;;
    video|audio)
      log $step
      [ $step = video ] && s=${VIDEO_LIMIT:-150} || s=${AUDIO_LIMIT:-170}
      lim $s $MT --only $step --out $R/$step.json > $R/$step-stdout.txt 2> $R/$step.txt
      echo "rc=$?" >> $R/$step.txt
      pack; grep -E "^(\||media_ttft: |  .*TTFT|Card|Qwen|Gemma|cold|rc=|Traceback|[A-Za-z]*(Error|Interrupt))" $R/$step.txt \
        | cut -c1-400 | tee -a $OUT/media-log.txt ;;
  esac
done
log done

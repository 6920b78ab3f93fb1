#!/usr/bin/env bash
# A whole H200 session in two device calls (each under the device tool's 10-minute limit; the
# second finds the extension already installed when the machine is still warm):
#   bench/h200_session.sh engine    bench/run_h200.sh full (CUDA tests, ceilings, X X^T, CacheMuon,
#                                   autotuner, optimizer steps, torch baselines, report), the
#                                   PyTorch front's GPU tests and the dedicated runtime at world
#                                   size 1 (bench/h200_front.sh, SKIP_EXAMPLE=1), and the
#                                   multi-GPU script's world-size-1 subset (bench/multi_gpu/run.sh)
#   bench/h200_session.sh front     the front's part of `engine` alone (also: run, multi; several
#                                   parts in one call as one argument: "front multi")
#   bench/h200_session.sh quality   the training-quality studies (bench/quality: LM and vision)
#                                   and their report
# Prepare here: tests/gpu/stage.sh, and for the vision study
#   python3 bench/quality/vision.py --save-digits .gpubin/digits.npz      (carry: [".gpubin"])
# Output under $OUT: session.log and one .tgz per part (the device tool returns few files).
# Each part runs under its own timeout (T_ENGINE, T_FRONT, T_MULTI, T_QUALITY seconds) so that
# what finished is packed even when a later part runs long.
set -o pipefail
export PYTHONUNBUFFERED=1
PART=${1:?engine, run, front, multi or quality (several: "front multi")}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$ROOT/out/session}
mkdir -p "$OUT"
cd "$ROOT"
LOG="$OUT/session.log"
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
PY=${PYTHON:-python3}
status=0

# step NAME TIMEOUT TITLE COMMAND...: one script under its timeout, its output's tail in the log,
# what it wrote under /tmp/s/NAME packed into $OUT/NAME.tgz (the device tool returns few files).
step() {
  local name=$1 limit=$2 title=$3
  shift 3
  say "$title"
  mkdir -p /tmp/s/$name
  OUT=/tmp/s/$name timeout "$limit" "$@" > /tmp/s-$name.out 2>&1 || status=1
  tail -60 /tmp/s-$name.out >> "$LOG"
  [ "$name" = multi_gpu ] && cp /tmp/mg/*.json /tmp/s/multi_gpu/ 2>/dev/null  # partial records too
  tar czf "$OUT/$name.tgz" -C /tmp/s/$name . && rm -rf /tmp/s/$name
}
front() {
  SKIP_EXAMPLE=1 step front "${T_FRONT:-220}" "h200_front.sh (SKIP_EXAMPLE=1): GPU pytest, NCCL test, dedicated runtime" \
    bash bench/h200_front.sh
}

multi() {
  step multi_gpu "${T_MULTI:-220}" "multi_gpu/run.sh (the world sizes this machine has)" bash bench/multi_gpu/run.sh
}
quality() {
  source bench/gpu_python_setup.sh || exit 1  # reuses the extension of the engine part when warm
  Q=/tmp/s/quality; mkdir -p $Q
  say "vision study (ResNet on the digits set)"
  $PY bench/quality/vision.py --digits .gpubin/digits.npz --out $Q/quality-vision.json ${VISION_ARGS:-} 2>&1 \
    | tee -a "$LOG" | grep -vE "^\[" ; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  say "language-model study (lm.py --size small by default; bench/quality/run_study.sh runs both sizes)"
  timeout ${T_QUALITY:-420} $PY bench/quality/lm.py --out $Q/quality-lm.json ${LM_ARGS:-} 2>&1 | tee -a "$LOG" | grep -vE "^\[" \
    ; [ "${PIPESTATUS[0]}" = 0 ] || status=1
  $PY bench/quality/report.py --lm $Q/quality-lm.json --vision $Q/quality-vision.json --out $Q/quality 2>&1 | tee -a "$LOG"
  tar czf "$OUT/quality.tgz" -C $Q . && rm -rf $Q
}

for part in $PART; do  # one part, or several in one call: "front multi"
  case "$part" in
  engine)
    step engine "${T_ENGINE:-140}" "run_h200.sh full" bash bench/run_h200.sh full
    front
    multi
    ;;
  run) step engine "${T_ENGINE:-140}" "run_h200.sh full" bash bench/run_h200.sh full ;;
  front) front ;;
  multi) multi ;;
  quality) quality ;;
  *) echo "unknown part '$part' (engine = run front multi, or quality)"; exit 2 ;;
  esac
done
say "done ($([ $status = 0 ] && echo all passed || echo FAILURES))"
exit $status

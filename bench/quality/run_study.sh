#!/usr/bin/env bash
# The CacheMuon quality study (bench/quality/README.md): every arm of lm.py at each model size and
# seed, then the report of every size recorded so far.
#
#   bench/quality/run_study.sh [SIZE...]    SIZE: small, medium (default: both), gpt2 (issue 43),
#                                           tiny or gpt2-smoke (CPU checks)
#
# OUT  (default out/quality-study): what a run keeps: quality.md, the plots and one summary JSON
#      per size (to record it, copy it under bench/results/ in place of the study's last record).
# RAW  (default /tmp/quality-study-raw): lm.py's per-step records and the log. On the device, RAW=$OUT
#      brings them back (the gpt2 study spans calls: the next one needs this one's record).
# DONE (optional): a folder of raw records from earlier calls (copied back into the tree and
#      carried): their (arm, seed) runs are skipped, and the report covers them with this call's.
# TAG  (optional): a suffix of the raw record's name (quality-lm-<size><TAG>.json), e.g. .c1, .c2,
#      so the records of several calls sit side by side.
# SEEDS, ARMS: lm.py's --seeds / --arms (default: the size's; gpt2: 0,1,2 and the issue-43 arms).
# LM_ARGS: more lm.py options. PYTHON (default python3).
# CALL_S (default 570): this call's wall-clock budget from the script's start, build included (a
#      device call runs at most 600 s). lm.py starts a run only if it should end in time (the
#      longest run so far decides) and lists the runs it left; the next call (DONE=...) runs them.
#      T_SIZE (default CALL_S) caps each size.
#
# Device time (estimates; README.md): gpt2, about 50 s a run on one H100: 15 runs = two calls (the
# extension's build, about 90 s, on a cold machine). small / medium: about 4 minutes each.
set -o pipefail
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
T0=$(date +%s)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/out/quality-study}
RAW=${RAW:-/tmp/quality-study-raw}
CALL_S=${CALL_S:-570}
SIZES=${*:-small medium}
mkdir -p "$OUT" "$RAW"
LOG=$RAW/study.log
say() { echo "=== $* ($(date +%T), $(( $(date +%s) - T0 )) s)" | tee -a "$LOG"; }
status=0

if ! $PY -c "import distmuon" 2>/dev/null; then
  source bench/gpu_python_setup.sh || exit 1  # the GPU machine: builds the extension from .gpubin
fi
# The raw records of a size: this call's and DONE's, each once (a warm machine may hold a copy).
records() {
  ls "$RAW"/quality-lm-"$1".json "$RAW"/quality-lm-"$1".*.json \
     ${DONE:+"$DONE"/quality-lm-"$1".json "$DONE"/quality-lm-"$1".*.json} 2>/dev/null |
    while read -r f; do echo "$(sha256sum < "$f" | cut -c1-16) $(basename "$f") $f"; done |
    sort -k2,2 | awk '!seen[$1]++ {print $3}'  # by name (.c1 before .c2), each content once
}
for size in $SIZES; do
  left=$(( CALL_S - ($(date +%s) - T0) - 30 ))  # 30 s kept for the report
  limit=$(( left < ${T_SIZE:-$CALL_S} ? left : ${T_SIZE:-$CALL_S} ))
  if [ "$limit" -lt 20 ]; then say "no time left for size $size"; status=1; continue; fi
  out="$RAW/quality-lm-$size${TAG:-}.json"
  skip=()
  if [ -n "${DONE:-}" ]; then
    while read -r f; do [ -n "$f" ] && [ "$f" != "$out" ] && skip+=("$f"); done < <(records "$size")
  fi
  extra=()
  [ ${#skip[@]} -gt 0 ] && extra=(--skip-done "${skip[@]}")
  say "language-model study, size $size${SEEDS:+, seeds $SEEDS}; $limit s for it; ${#skip[@]} earlier records"
  # Per-step lines go to the log only; the size's setting, each finished run and the table are shown.
  # shellcheck disable=SC2086
  timeout "$limit" $PY bench/quality/lm.py --size "$size" ${SEEDS:+--seeds "$SEEDS"} ${ARMS:+--arms "$ARMS"} \
    --time-budget $(( limit - 10 )) "${extra[@]}" --out "$out" ${LM_ARGS:-} 2>&1 |
    tee -a "$LOG" | grep -v "^\["
  [ "${PIPESTATUS[0]}" = 0 ] || { say "lm.py --size $size failed or ran out of time"; status=1; }
done
raws=()
for size in tiny small medium gpt2-smoke gpt2; do
  while read -r f; do [ -n "$f" ] && raws+=("$f"); done < <(records "$size")
done
if [ ${#raws[@]} -gt 0 ]; then
  $PY bench/quality/report.py --lm "${raws[@]}" --out "$OUT/quality" 2>&1 | tee -a "$LOG" || status=1
fi
say "done ($([ $status = 0 ] && echo all passed || echo FAILURES)); report: $OUT/quality.md"
exit $status

#!/usr/bin/env bash
# The CacheMuon quality study (bench/quality/README.md): every arm of lm.py (the size's AdamW
# rates and MUON_ARMS) at each model size and seed, then the report of every size recorded so far.
#
#   bench/quality/run_study.sh [SIZE...]          SIZE: small, medium (default: both), tiny (a check)
#
# OUT  (default out/quality-study): what a run keeps: quality.md, the plots and one summary JSON
#      per size (to record it, copy it under bench/results/ in place of the study's last record).
# RAW  (default /tmp/quality-study-raw): lm.py's per-step records and the log, outside the tree.
# SEEDS (default 0,1), LM_ARGS (more lm.py options), T_SIZE (seconds per size, default 570: an
# arm cut short is lost, the arms before it are kept), PYTHON (default python3).
#
# Expected device time on one H200 (estimated, not measured, from the previous study's 33 ms per
# step at batch 32 of the medium shape; README.md): about 4 minutes per size at two seeds, plus the extension's
# build on a cold machine. One device call runs at most 10 minutes, so run one size per call on
# the same warm machine: `run_study.sh small`, then `run_study.sh medium` (its report covers both).
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/out/quality-study}
RAW=${RAW:-/tmp/quality-study-raw}
SEEDS=${SEEDS:-0,1}
SIZES=${*:-small medium}
mkdir -p "$OUT" "$RAW"
LOG=$RAW/study.log
say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
status=0

if ! $PY -c "import distmuon" 2>/dev/null; then
  source bench/gpu_python_setup.sh || exit 1  # the GPU machine: builds the extension from .gpubin
fi
for size in $SIZES; do
  say "language-model study, size $size, seeds $SEEDS"
  # Per-step lines go to the log only; the size's setting and final table are shown.
  # shellcheck disable=SC2086
  timeout "${T_SIZE:-570}" $PY bench/quality/lm.py --size "$size" --seeds "$SEEDS" \
    --out "$RAW/quality-lm-$size.json" ${LM_ARGS:-} 2>&1 | tee -a "$LOG" | grep -v "^\["
  [ "${PIPESTATUS[0]}" = 0 ] || { say "lm.py --size $size failed or ran out of time"; status=1; }
done
raws=()
for size in tiny small medium; do
  [ -f "$RAW/quality-lm-$size.json" ] && raws+=("$RAW/quality-lm-$size.json")
done
if [ ${#raws[@]} -gt 0 ]; then
  $PY bench/quality/report.py --lm "${raws[@]}" --out "$OUT/quality" 2>&1 | tee -a "$LOG" || status=1
fi
say "done ($([ $status = 0 ] && echo all passed || echo FAILURES)); report: $OUT/quality.md"
exit $status

#!/usr/bin/env bash
# A/B of the optimizer step between two builds on one GPU: distmuon-cuda-bench of build A and of
# build B run alternately (A B A B ...), so that clock and thermal drift fall on both; then the
# median per workload and build, and B / A (bench/ab_summary.py).
#   bench/ab_h200.sh BIN_A BIN_B OUT_DIR [ROUNDS=2] [WORKLOADS=gpt2-small,gpt2-large,pi0,qwen2.5-7b:8]
# BIN_A / BIN_B: folders holding distmuon-cuda-bench. Autotuning is off in both (the same
# untuned `auto` choices), so the comparison is of the runtime around the kernels.
set -euo pipefail
A=$1 B=$2 OUT=$3 ROUNDS=${4:-2} WL=${5:-gpt2-small,gpt2-large,pi0,qwen2.5-7b:8}
mkdir -p "$OUT"
export DISTMUON_AUTOTUNE=off
for r in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    bin=$A; [ "$side" = B ] && bin=$B
    echo "=== round $r, build $side ($(date +%T))"
    "$bin/distmuon-cuda-bench" --no-micro --no-tune --no-cache --workloads "$WL" \
      --json "$OUT/$side-$r.json" 2>&1 | grep -E "^\s*\S+.*ms" | tail -n 8 || true
  done
done
python3 "$(dirname "$0")/ab_summary.py" "$OUT" | tee "$OUT/ab.md"

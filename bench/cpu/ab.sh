#!/usr/bin/env bash
# Interleaved A/B of distmuon-bench on the demo's shapes: ab.sh ROUNDS LABEL=BINDIR ...
# Per round and binary: one thread (OMP_NUM_THREADS=1; CPU time user+sys of the process over
# its steps), idle (two threads) and busy (two threads beside a one-core spinner, killed by pid).
# Prints: label mode median_ms min_ms cpu_s (cpu_s: user+sys of the whole run, 310 steps + setup).
set -u
rounds=$1; shift
here=$(cd "$(dirname "$0")" && pwd)
wl=$here/demo-gpt.json
export OMP_WAIT_POLICY=passive DISTMUON_NUM_THREADS=1
run() {  # label bindir mode
  local out t
  t=$( { /usr/bin/time -f "%U %S" "$2/distmuon-bench" --workload "$wl" --algo auto --steps 300 \
          --warmup 10 > /tmp/ab.$$ ; } 2>&1 | tail -1)
  out=$(grep '^auto ' /tmp/ab.$$ | tail -1)
  echo "$1 $3 $(echo "$out" | awk '{print $2, $3}') $(echo "$t" | awk '{printf "%.2f", $1 + $2}')"
}
for ((i = 0; i < rounds; i++)); do
  for spec in "$@"; do
    label=${spec%%=*}; dir=${spec#*=}
    OMP_NUM_THREADS=1 run "$label" "$dir" 1thread
    run "$label" "$dir" idle
    python3 -c "import time; t = time.time() + 30
while time.time() < t: pass" & spin=$!
    run "$label" "$dir" busy
    kill "$spin"; wait "$spin" 2>/dev/null
  done
done
rm -f /tmp/ab.$$

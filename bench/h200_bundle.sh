#!/usr/bin/env bash
# Sourced by the bench scripts that run the staged binaries on the device (h200_*.sh), from the
# repository root (ROOT).
#   bundle_preamble NAME   what each of them starts with: OUT (default $ROOT/out) created, the log
#                          $OUT/NAME.log and a `say` that writes to it, then use_bundle
#   use_bundle             unpacks .gpubin/bundle.tar.xz (tests/gpu/stage.sh) into /tmp/dm unless
#                          a warm machine already holds this very bundle; sets BIN and the paths
#   profile_steps "SPECS"  Nsight Compute's per-kernel time of gram-ns steps (1 warm-up + 2) of
#                          each workload spec (name or name:layers), grouped by kernel_profile.py;
#                          $OUT/profile.tgz holds one .md and one .csv.xz each. Non-zero if one failed.

bundle_preamble() {
  OUT=${OUT:-$ROOT/out}
  mkdir -p "$OUT"
  LOG="$OUT/$1.log"
  say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
  use_bundle
}

use_bundle() {
  local sum
  sum=$(sha256sum .gpubin/bundle.tar.xz | cut -c1-16) || return 1
  if [ "$(cat /tmp/dm/bundle.sum 2>/dev/null)" != "$sum" ]; then
    say "unpacking the prebuilt bundle"
    rm -rf /tmp/dm && mkdir -p /tmp/dm
    tar xJf .gpubin/bundle.tar.xz -C /tmp/dm || { say "the bundle does not unpack"; return 1; }
    echo "$sum" > /tmp/dm/bundle.sum
  fi
  BIN=/tmp/dm/bin
  local cublas_dirs
  cublas_dirs=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib 2>/dev/null | tr '\n' ':')
  export LD_LIBRARY_PATH=/tmp/dm/lib:$cublas_dirs${LD_LIBRARY_PATH:-}
  if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
}

profile_steps() {
  local spec name layers failed=0
  rm -rf /tmp/prof && mkdir -p /tmp/prof
  for spec in $1; do
    name=${spec%%:*}; layers=0; [ "$name" != "$spec" ] && layers=${spec##*:}
    say "ncu: $spec, gram-ns, 1 warm-up + 2 steps"
    ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \
      --print-kernel-base demangled \
      "$BIN/distmuon-bench" --backend cuda --workload "$name" --layers "$layers" --algo gram-ns \
      --no-adamw --warmup 1 --steps 2 > "/tmp/prof/$name.csv" 2>> "$LOG" || failed=1
    python3 bench/kernel_profile.py "/tmp/prof/$name.csv" --steps 3 --md "/tmp/prof/$name.md" \
      > "/tmp/prof/$name.out" 2>&1 || failed=1
    head -12 "/tmp/prof/$name.out" | tee -a "$LOG"
    rm -f "/tmp/prof/$name.out"
  done
  xz -9 -f /tmp/prof/*.csv
  tar czf "$OUT/profile.tgz" -C /tmp/prof .
  return $failed
}

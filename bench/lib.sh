#!/usr/bin/env bash
# Sourced by the device scripts that run staged binaries (ab.sh, profile.sh, auto_check.sh), from
# the repository root (ROOT).
#   bundle_preamble NAME    OUT (default $ROOT/out) created, the log $OUT/NAME.log and a `say`
#                           that writes to it, then use_bundle
#   use_bundle              .gpubin/bundle.tar.xz (tests/gpu/stage.sh) unpacked into /tmp/dm; sets
#                           BIN and the library paths
#   unpack TARBALL DIR      unpacks a bundle unless DIR already holds this very one (a warm machine)
#   run_tests TESTS [MEMCHECK]   each gtest binary of TESTS, then compute-sanitizer's memcheck over
#                           each of MEMCHECK (default: TESTS); an entry is `binary` or
#                           `binary:gtest-filter`. Non-zero if one failed.
#   ncu_steps BINDIR SPEC CSV [ARGS...]   Nsight Compute over distmuon-bench steps (1 warm-up + 2) of
#                           one workload spec (name, name:layers or a JSON file), NCU_ARGS (default:
#                           the per-kernel duration) and the bench's ARGS (default --algo gram-ns)
#   profile_steps "SPECS" [TAG] [ARGS...]   ncu_steps with $BIN for each spec, grouped by
#                           kernel_profile.py; $OUT/profile[-TAG].tgz holds one .md and one .csv.xz
#                           each. Non-zero if one failed.

bundle_preamble() {
  OUT=${OUT:-$ROOT/out}
  mkdir -p "$OUT"
  LOG="$OUT/$1.log"
  say() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }
  use_bundle
}

unpack() {
  local sum
  sum=$(sha256sum "$1" | cut -c1-16) || return 1
  if [ "$(cat "$2/bundle.sum" 2>/dev/null)" != "$sum" ]; then
    say "unpacking $1"
    rm -rf "$2" && mkdir -p "$2"
    tar xJf "$1" -C "$2" || { say "$1 does not unpack"; return 1; }
    echo "$sum" > "$2/bundle.sum"
  fi
}

use_bundle() {
  unpack .gpubin/bundle.tar.xz /tmp/dm || return 1
  BIN=/tmp/dm/bin
  local cublas_dirs
  cublas_dirs=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib 2>/dev/null | tr '\n' ':')
  export LD_LIBRARY_PATH=/tmp/dm/lib:$cublas_dirs${LD_LIBRARY_PATH:-}
  if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
}

run_tests() {
  local entry bin failed=0
  local -a tests checks filter
  read -ra tests <<< "$1"
  read -ra checks <<< "${2-$1}"
  for entry in "${tests[@]}"; do
    bin=${entry%%:*}; filter=(); [ "$bin" != "$entry" ] && filter=("--gtest_filter=${entry#*:}")
    say "$bin ${filter[*]}"
    "$BIN/$bin" --gtest_brief=1 "${filter[@]}" 2>&1 | tee -a "$LOG" \
      | grep -E "^\[measure\]|PASSED|FAILED|Failure|error" | head -40
    [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  done
  for entry in "${checks[@]}"; do
    bin=${entry%%:*}; filter=(); [ "$bin" != "$entry" ] && filter=("--gtest_filter=${entry#*:}")
    say "memcheck over $bin ${filter[*]}"
    compute-sanitizer --tool memcheck --error-exitcode 3 --report-api-errors no "$BIN/$bin" \
      --gtest_brief=1 "${filter[@]}" 2>&1 | tee -a "$LOG" | tail -3
    [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  done
  return $failed
}

ncu_steps() {
  local bindir=$1 spec=$2 csv=$3 name layers
  shift 3
  [ $# -gt 0 ] || set -- --algo gram-ns
  name=${spec%%:*}; layers=0; [ "$name" != "$spec" ] && layers=${spec##*:}
  # shellcheck disable=SC2086
  ncu --clock-control none ${NCU_ARGS:---metrics gpu__time_duration.sum} --csv --page raw \
    --print-kernel-base demangled \
    "$bindir/distmuon-bench" --backend cuda --workload "$name" --layers "$layers" --no-adamw \
    --warmup 1 --steps 2 "$@" > "$csv" 2>> "$LOG"
}

profile_steps() {
  local specs=$1 tag=${2:-} spec name failed=0
  shift 2 2>/dev/null || shift $#
  rm -rf /tmp/prof && mkdir -p /tmp/prof
  for spec in $specs; do
    name=$(basename "${spec%%:*}" .json)
    say "ncu: $spec ${*:---algo gram-ns}, 1 warm-up + 2 steps"
    ncu_steps "$BIN" "$spec" "/tmp/prof/$name.csv" "$@" || failed=1
    python3 bench/kernel_profile.py "/tmp/prof/$name.csv" --steps 3 --md "/tmp/prof/$name.md" \
      > "/tmp/prof/$name.out" 2>&1 || failed=1
    head -12 "/tmp/prof/$name.out" | tee -a "$LOG"
    rm -f "/tmp/prof/$name.out"
  done
  xz -9 -f /tmp/prof/*.csv
  tar czf "$OUT/profile${tag:+-$tag}.tgz" -C /tmp/prof .
  return $failed
}

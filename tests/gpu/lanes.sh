# The suites of the GPU verification, in the four lanes tests/gpu/verify.sh runs at once (sourced
# by it in a child shell per lane). Expects WORK, LOG, BIN, PY, RANKS and NGPU in the environment.

# run_suite NAME RANKS TIMEOUT CMD...: one suite, its output in $WORK/NAME.log, its verdict a line
# of $WORK/suites.jsonl (summarize.py adds the gtest / pytest reports a suite wrote).
run_suite() {
  local name=$1 ranks=$2 limit=$3
  shift 3
  local t rc
  t=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  printf '{"name": "%s", "ranks": %s, "rc": %s, "seconds": %s}\n' "$name" "$ranks" "$rc" \
    "$(( $(date +%s) - t ))" >> "$WORK/suites.jsonl"
  echo "[$name] $([ $rc = 0 ] && echo passed || echo "FAILED (exit $rc)") in $(( $(date +%s) - t )) s" | tee -a "$LOG"
  [ $rc = 0 ] || tail -25 "$WORK/$name.log" | sed "s/^/    [$name] /" >> "$LOG"
  return 0
}

# One at a time: the suites that hold the most device memory (the 4-rank and larger engine suite,
# the front's NCCL fixtures). Beside each other on an 80 GB H100 they reached 74 GB and ran out
# of memory (2026-12-06); the other suites still run beside either.
heavy() { ( flock 9; "$@" ) 9> "$WORK/heavy.lock"; }

MPIRUN=(mpirun --allow-run-as-root --oversubscribe --bind-to none -x PATH -x LD_LIBRARY_PATH
        -x NCCL_NVLS_ENABLE -x NCCL_MULTI_RANK_GPU_ENABLE -x DISTMUON_COMM_TIMEOUT_S
        -x DISTMUON_AUTOTUNE -x DISTMUON_TEST_JSON_DIR)
[ -n "${LD_PRELOAD:-}" ] && MPIRUN+=(-x LD_PRELOAD)

# The CUDA gtests and the single-process NCCL test; the distributed engine on the NCCL rig at the
# rank counts above 2 (the longest suites: the engine at 2 ranks runs in the sanitizer lane, the
# rig's other suites and the fault tests in the bench lane).
lane_cpp() {
  local t n
  for t in test_cuda_backend test_cuda_grouped test_cuda_muon test_cuda_cache test_cuda_tune test_nccl_comm; do
    [ -x "$BIN/$t" ] || continue
    run_suite "$t" 1 300 "$BIN/$t" --gtest_output="json:$WORK/$t.gtest.json"
  done
  nccl_dist_suites "$(ranks_where '$1 > 2')" engine
}

# The rank counts of $RANKS that satisfy an awk condition on $1, as a comma list.
ranks_where() { tr , '\n' <<< "$RANKS" | awk "$1" | paste -sd, ; }

# Above 4 ranks (time-sliced on one GPU, 2-3x slower per case) the engine runs what depends on
# the rank count: every mode against the single process, ranks that own nothing, the dedicated
# caller path. The raise policy, checkpoints and half-precision cases ran at 2 and 4 ranks.
ENGINE_FILTER_LARGE='*EveryMode*:*RanksThatOwnNothing*:*DedicatedCaller*'

# The distributed C++ tests $2 (of comm, engine, errors, dedicated) on the NCCL rig at each rank
# count of the comma list $1.
nccl_dist_suites() {
  local n t
  for n in ${1//,/ }; do
    for t in $2; do
      mkdir -p "$WORK/nccl_dist_$t-$n"
      local filter=()
      [ "$t" = engine ] && [ "$n" -gt 4 ] && filter=(--gtest_filter="$ENGINE_FILTER_LARGE")
      local turn=()
      [ "$t" = engine ] && [ "$n" -ge 4 ] && turn=(heavy)
      DISTMUON_TEST_JSON_DIR="$WORK/nccl_dist_$t-$n" \
        "${turn[@]}" run_suite "nccl_dist_$t-$n" "$n" 300 "${MPIRUN[@]}" -np "$n" "$BIN/test_nccl_dist_$t" \
        "${filter[@]}"
    done
  done
}

# The GPU pytest modules: one process (with the import order of distmuon and torch, which only a
# CUDA build can get wrong), then the front over NCCL ranks: FSDP2, HSDP, DDP, dedicate(), mixed
# precision, then tensor x FSDP2 and expert parallelism at 4 ranks (test_gpu_tp.py, after
# test_gpu_distributed.py: it writes the report of both when it ends). Uncaptured (-s): the ranks
# say which arm they start, and a lane killed at its limit keeps that in its log.
lane_python() {
  run_suite pytest_gpu 1 300 "$PY" -m pytest tests/python/test_gpu.py tests/python/test_autotune.py \
    tests/python/test_import_order.py \
    -q -rs -p no:cacheprovider \
    --junitxml="$WORK/pytest_gpu.xml"
  DISTMUON_TEST_RANKS="$RANKS" DISTMUON_TEST_REPORT="$WORK/front.json" \
    heavy run_suite pytest_gpu_distributed 0 $(( LANE_TIMEOUT_S - 80 )) "$PY" -m pytest \
    tests/python/test_gpu_distributed.py tests/python/test_gpu_tp.py -q -rs -s -p no:cacheprovider \
    --junitxml="$WORK/pytest_gpu_distributed.xml"
}

# compute-sanitizer: memcheck over the GPU gtests, racecheck and synccheck over the kernels'
# tests (they follow every shared-memory access: slow), memcheck over a 2-rank NCCL engine run;
# then the engine on the NCCL rig at 2 ranks (this lane has the time).
lane_sanitizer() {
  # API errors are left out: NCCL probes for kernel images it was not built with (error 209) and
  # carries on; the project's own CUDA calls are all checked (DM_CHECK_CUDA) anyway.
  local cs=(compute-sanitizer --error-exitcode 3 --print-limit 20 --report-api-errors no) t tool
  if ! command -v compute-sanitizer > /dev/null; then
    run_suite sanitizer_missing 1 10 false
    nccl_dist_suites "$(ranks_where '$1 <= 2')" engine
    return
  fi
  for t in test_cuda_backend test_cuda_grouped test_cuda_muon test_cuda_cache test_nccl_comm; do
    [ -x "$BIN/$t" ] && run_suite "sanitizer_memcheck_$t" 1 300 "${cs[@]}" --tool memcheck "$BIN/$t" --gtest_brief=1
  done
  for tool in racecheck synccheck; do
    # racecheck fails on hazards in our kernels only (it reports some inside cuBLASLt's).
    local judge=()
    [ "$tool" = racecheck ] && judge=(bash tests/gpu/racecheck_ours.sh)
    run_suite "sanitizer_${tool}_backend" 1 300 "${judge[@]}" "${cs[@]}" --tool "$tool" \
      "$BIN/test_cuda_backend" --gtest_brief=1 --gtest_filter='*Sym*:*BatchedHelpers*:*AdamW*'
    run_suite "sanitizer_${tool}_muon" 1 300 "${judge[@]}" "${cs[@]}" --tool "$tool" \
      "$BIN/test_cuda_muon" --gtest_brief=1 --gtest_filter='CudaMuon.Passes*'
    run_suite "sanitizer_${tool}_grouped" 1 300 "${judge[@]}" "${cs[@]}" --tool "$tool" \
      "$BIN/test_cuda_grouped" --gtest_brief=1 --gtest_filter='*EveryProblem*'
  done
  run_suite sanitizer_memcheck_nccl_engine-2 2 400 "${MPIRUN[@]}" -np 2 "${cs[@]}" --tool memcheck \
    "$BIN/test_nccl_dist_engine" --gtest_filter='*sharded*:*dedicated*:*Caller*'
  nccl_dist_suites "$(ranks_where '$1 <= 2')" engine  # the cpp lane has the longer ones
}

# Traffic and orthogonalization FLOPs per rank of each mode, beside the simulator's prediction
# (bf16 parameters and gradients: the simulator's wire dtype); the NCCL rig's communicator, error
# and dedicated-transfer suites; then the fault tests at up to 4 ranks (a stalled and a killed
# rank; tests/gpu/nccl_faults.py).
lane_bench() {
  local n
  for n in ${RANKS//,/ }; do
    # Planned on analytic costs, as distmuon-plan below, so that the bytes compare plan for plan.
    run_suite "bench-$n" "$n" 300 env DISTMUON_PLAN_COSTS=analytic "${MPIRUN[@]}" \
      -x DISTMUON_PLAN_COSTS -np "$n" "$BIN/distmuon-bench" --backend cuda \
      --workload gpt2-small --dtype bf16 --no-adamw --mode gather,sharded,dedicated --steps 3 \
      --warmup 1 \
      --ranks-per-gpu $(( (n + NGPU - 1) / NGPU )) --json "$WORK/bench-$n.json"
    run_suite "plan-$n" 1 120 "$BIN/distmuon-plan" --workload gpt2-small --world-size "$n" \
      --gpus-per-node "$n" --analytic --solver milp --simulate --json "$WORK/plan-$n.json"
  done
  nccl_dist_suites "$RANKS" "comm errors dedicated"
  run_suite faults 0 300 "$PY" tests/gpu/nccl_faults.py --probe "$BIN/nccl_fault_probe" \
    --ranks "$(ranks_where '$1 <= 4')" --repeat 2 --json "$WORK/faults.json"
}

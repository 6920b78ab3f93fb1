"""Fault tests of the distributed engine over NCCL: one rank stops stepping, or is killed in the
middle of a step; every other rank must raise within DISTMUON_COMM_TIMEOUT_S plus SLACK_S.

    python3 tests/gpu/nccl_faults.py --probe build/bin/nccl_fault_probe --ranks 2,4 [--repeat 3] --json out.json

Each case starts the ranks as plain processes (nccl_fault_probe.cc says why there is no mpirun),
all on the GPUs this machine has (several ranks per GPU need NCCL >= 2.30 and
NCCL_MULTI_RANK_GPU_ENABLE=1). Prints one line per case and exits non-zero if any case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

TIMEOUT_S = 10.0
# What may pass the timeout: the deadline runs from when the collective was issued (a little
# after the step began), then the host polls, aborts the communicator and unwinds.
SLACK_S = 5.0


def run_case(probe: str, ranks: int, fault: str, mode: str) -> dict:
    # Debug lines give each rank's timeline (collectives issued, host waits for the device, with
    # seconds since start), kept for the ranks that raised late or not at all.
    env = dict(os.environ, DISTMUON_COMM_TIMEOUT_S=str(TIMEOUT_S), DISTMUON_AUTOTUNE="off",
               DISTMUON_LOG_LEVEL="debug")
    with tempfile.TemporaryDirectory() as rendezvous:
        t0 = time.monotonic()
        procs = [
            subprocess.Popen(
                [probe, rendezvous, str(r), str(ranks), fault, mode],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(ranks)
        ]
        outs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=4 * TIMEOUT_S + 60)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
                out += "\n<hung: killed by the test>"
            outs.append((p.returncode, out))
        wall = time.monotonic() - t0
    survivors = outs[:-1]
    delays, problems, timelines = [], [], {}
    for r, (code, out) in enumerate(survivors):
        line = next((ln for ln in out.splitlines() if ln.startswith("raised ")), None)
        if code != 0 or line is None:
            problems.append(f"rank {r} (exit {code}): {out.strip()[-400:]}")
            timelines[r] = out.splitlines()[-40:]
            continue
        delay = float(line.split()[1])
        delays.append(delay)
        if delay > TIMEOUT_S + SLACK_S:
            problems.append(f"rank {r} raised after {delay:.1f} s: {line}")
            timelines[r] = out.splitlines()[-40:]
        elif "DISTMUON_COMM_TIMEOUT_S" not in line and "failed" not in line:
            problems.append(f"rank {r} raised an error that names neither the timeout nor a failure: {line}")
    faulty_code = outs[-1][0]
    if fault == "kill" and faulty_code != -9:
        problems.append(f"the faulty rank was to die of SIGKILL, exit code {faulty_code}")
    example = next((ln for _, o in survivors for ln in o.splitlines() if ln.startswith("raised ")), "")
    return {
        "ranks": ranks,
        "fault": fault,
        "mode": mode,
        "passed": not problems,
        "raise_after_s": max(delays) if delays else None,
        "timeout_s": TIMEOUT_S,
        "slack_s": SLACK_S,
        "wall_s": round(wall, 1),
        "message": example[:300],
        "problems": problems,
        "timelines": timelines,  # the last output lines of the ranks with a problem
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe", required=True, help="the nccl_fault_probe executable")
    ap.add_argument("--ranks", default="2,4", help="comma list of rank counts")
    ap.add_argument("--modes", default="sharded,dedicated", help="engine modes, taken in turn by the cases")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each case (timing-dependent faults)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    results = []
    modes = args.modes.split(",")
    cases = [(int(n), fault) for n in args.ranks.split(",") for fault in ("stop", "kill")] * args.repeat
    for i, (n, fault) in enumerate(cases):
        r = run_case(args.probe, n, fault, modes[i % len(modes)])  # the modes in turn
        results.append(r)
        verdict = "ok  " if r["passed"] else "FAIL"
        after = f"{r['raise_after_s']:.1f} s" if r["raise_after_s"] is not None else "-"
        print(f"[faults] {verdict} {n} ranks, {fault:4}, {r['mode']:9}: the others raised after {after} "
              f"(timeout {TIMEOUT_S:.0f} s + {SLACK_S:.0f} s slack)", flush=True)
        for p in r["problems"]:
            print(f"         {p}", flush=True)
        for rank, lines in r["timelines"].items():
            print(f"         rank {rank}'s last lines:", flush=True)
            for ln in lines:
                print(f"           {ln}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

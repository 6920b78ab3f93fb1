"""The GPU verification's record: summary.json and summary.md from what tests/gpu/verify.sh's
lanes left in its work folder (suites.jsonl, gtest JSON reports per rank, pytest JUnit XML, the
front's and the fault tests' JSON, distmuon-bench and distmuon-plan JSON). Exits 1 when any
suite failed (or ran nothing at all)."""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import Any

# test_dist_engine.cc's parameterised test -> suite (the mode; every HSDP layout is "hsdp").
ENGINE_SUITE = re.compile(r"EveryMode\.EqualsTheSingleProcessEngine/(\w+)")
# test_gpu_distributed.py's arms (gpu_dist_scenarios.py) and test_gpu_tp.py's -> suite.
ARM_SUITE = [
    ("fsdp2_autocast", "mixed-precision"),
    ("fsdp2_mp", "mixed-precision"),
    ("fsdp2-bf16ns", "fsdp2"),
    ("dedicated-autocast", "mixed-precision"),
    ("fsdp2", "fsdp2"),
    ("hsdp", "hsdp"),
    ("ddp", "ddp"),
    ("gather", "gather"),
    ("cache", "cache"),
    ("dedicated", "dedicated"),
    ("dcp", "dcp"),
    ("tp", "tensor-parallel"),  # test_gpu_tp.py's arms (tp_scenarios.py)
    ("ep", "expert-parallel"),
]


class Suites:
    """Counts per (layer, name, ranks)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str, int], dict[str, Any]] = {}

    def add(self, layer: str, name: str, ranks: int, ok: bool, diff: float | None = None, case: str = "") -> None:
        row = self.rows.setdefault(
            (layer, name, ranks),
            {"name": name, "layer": layer, "ranks": ranks, "passed": 0, "failed": 0, "max_abs_diff": None, "failures": []},
        )
        row["passed" if ok else "failed"] += 1
        if not ok and case:
            row["failures"].append(case)
        if diff is not None:
            row["max_abs_diff"] = max(diff, row["max_abs_diff"] or 0.0)

    def list(self) -> list[dict[str, Any]]:
        return [self.rows[k] for k in sorted(self.rows, key=lambda k: (k[0], k[1], k[2]))]


def load_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def gtest_cases(reports: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Test name -> {ok, skipped, diff} over the reports of every rank (ok on every rank)."""
    out: dict[str, dict[str, Any]] = {}
    for rep in reports:
        for suite in rep.get("testsuites", []):
            for t in suite.get("testsuite", []):
                name = f"{suite['name']}.{t['name']}"
                c = out.setdefault(name, {"ok": True, "skipped": False, "diff": None})
                c["ok"] &= not t.get("failures")
                c["skipped"] |= t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN"
                if "max_abs_diff" in t:
                    c["diff"] = max(float(t["max_abs_diff"]), c["diff"] or 0.0)
    return out


def suite_of_engine_test(name: str) -> str:
    m = ENGINE_SUITE.search(name)
    if not m:
        return "engine-other"
    mode = m.group(1)
    return "hsdp" if mode.endswith("_hsdp") else mode


def junit_cases(path: str) -> dict[str, bool | None]:
    """Test name -> passed (None: skipped)."""
    out: dict[str, bool | None] = {}
    if not os.path.exists(path):
        return out
    for tc in ET.parse(path).getroot().iter("testcase"):
        if tc.find("skipped") is not None:
            out[tc.get("name", "")] = None
        else:
            out[tc.get("name", "")] = tc.find("failure") is None and tc.find("error") is None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for a in ("--work", "--out", "--gpu", "--nccl", "--ranks", "--command"):
        ap.add_argument(a, required=True)
    ap.add_argument("--ngpu", type=int, required=True)
    ap.add_argument("--seconds", type=int, default=0)
    args = ap.parse_args()
    w = args.work
    suites = Suites()
    runs = [json.loads(line) for line in open(os.path.join(w, "suites.jsonl"))] if os.path.exists(os.path.join(w, "suites.jsonl")) else []
    rc = {r["name"]: r for r in runs}

    # C++: single-process GPU gtests.
    for t, name in (("test_cuda_backend", "cuda-kernels"), ("test_cuda_grouped", "cuda-kernels"), ("test_cuda_muon", "cuda-kernels"), ("test_cuda_cache", "cuda-kernels"),
                    ("test_cuda_tune", "cuda-kernels"), ("test_nccl_comm", "nccl-single")):
        if t not in rc:
            continue
        cases = gtest_cases([j] if (j := load_json(os.path.join(w, f"{t}.gtest.json"))) else [])
        if not cases:
            suites.add("cpp", name, 1, False, case=f"{t}: no report (exit {rc[t]['rc']})")
        for case, c in cases.items():
            if not c["skipped"]:
                suites.add("cpp", name, 1, c["ok"], case=f"{t} {case}")
    # C++: the distributed tests on the NCCL rig.
    for d in sorted(glob.glob(os.path.join(w, "nccl_dist_*-*"))):
        if not os.path.isdir(d):
            continue
        base = os.path.basename(d)
        kind, n = base[len("nccl_dist_") :].rsplit("-", 1)
        reports = [j for p in sorted(glob.glob(os.path.join(d, "rank*.json"))) if (j := load_json(p))]
        cases = gtest_cases(reports)
        if len(reports) < int(n) or (rc.get(base, {}).get("rc", 1) != 0 and all(c["ok"] for c in cases.values())):
            suites.add("cpp", {"engine": "engine", "comm": "nccl-comm", "errors": "errors", "dedicated": "dedicated-transfers"}[kind], int(n), False,
                       case=f"{base}: exit {rc.get(base, {}).get('rc')}, {len(reports)} of {n} rank reports")
        for case, c in cases.items():
            if c["skipped"]:
                continue
            name = suite_of_engine_test(case) if kind == "engine" else {"comm": "nccl-comm", "errors": "errors", "dedicated": "dedicated-transfers"}[kind]
            suites.add("cpp", name, int(n), c["ok"], c["diff"], case=f"{base} {case}")
    # Fault tests.
    faults = load_json(os.path.join(w, "faults.json")) or []
    for f in faults:
        suites.add("cpp", "faults", f["ranks"], f["passed"], case=f"{f['fault']} {f['mode']}: {'; '.join(f['problems'])}")
    if "faults" in rc and not faults:
        suites.add("cpp", "faults", 0, False, case=f"no results (exit {rc['faults']['rc']})")
    # Python front.
    for t, path in (("pytest_gpu", "pytest_gpu.xml"),):
        for case, ok in junit_cases(os.path.join(w, path)).items():
            if ok is not None:
                suites.add("python", "front-single-gpu", 1, ok, case=case)
        if t in rc and not junit_cases(os.path.join(w, path)):
            suites.add("python", "front-single-gpu", 1, False, case=f"no report (exit {rc[t]['rc']})")
    front = load_json(os.path.join(w, "front.json")) or {}
    verdicts = junit_cases(os.path.join(w, "pytest_gpu_distributed.xml"))
    for arm, r in front.items():
        name = next((s for prefix, s in ARM_SUITE if arm.startswith(prefix)), "front-other")
        test = r.get("test", "")
        ok = verdicts.get(test)
        suites.add("python", name, r["ranks"], bool(ok), r["max_abs_diff"], case=f"{arm} ({test})")
    linked = {r.get("test", "") for r in front.values()}
    for case, ok in verdicts.items():  # failures no arm recorded (a launch that failed, say)
        if ok is False and case not in linked:
            suites.add("python", "front-distributed", 0, False, case=case)
    if "pytest_gpu_distributed" in rc and not front:
        suites.add("python", "front-distributed", 0, False, case=f"no results (exit {rc['pytest_gpu_distributed']['rc']})")
    # Sanitizer.
    for name, r in rc.items():
        if name.startswith("sanitizer"):
            suites.add("cpp", "sanitizer", r["ranks"], r["rc"] == 0, case=f"{name} (exit {r['rc']})")

    # Traffic and FLOPs per rank: measured (distmuon-bench) beside the simulator.
    traffic = []
    for n in [int(x) for x in args.ranks.split(",") if x]:
        bench = load_json(os.path.join(w, f"bench-{n}.json"))
        plan = load_json(os.path.join(w, f"plan-{n}.json"))
        point = next((p for p in (plan or {}).get("simulate", {}).get("points", []) if p["world"] == n), {})
        for r in (bench or {}).get("runs", []):
            mode = r["mode"]
            traffic.append({
                "ranks": n,
                "mode": mode,
                "comm_bytes_per_rank": r["comm_bytes_per_rank"],
                "engine_comm_bytes_per_rank": r.get("engine_comm_bytes_per_rank"),
                "ortho_flops_max_rank": r["ortho_flops_max_rank"],
                "ortho_flops_mean_rank": r["ortho_flops_mean_rank"],
                "predicted_bytes_per_rank": point.get(f"{mode}_bytes"),
                "predicted_ortho_flops_max_rank": point.get("gather_flops" if mode == "gather" else "owner_flops_max"),
                "predicted_ms": point[mode] * 1e3 if mode in point else None,
            })
        if f"bench-{n}" in rc:
            suites.add("cpp", "bench", n, rc[f"bench-{n}"]["rc"] == 0 and bool(bench), case=f"bench-{n}")

    rows = suites.list()
    failed = sum(r["failed"] for r in rows)
    summary = {
        "command": args.command,
        "date": datetime.date.today().isoformat(),
        "gpu": args.gpu,
        "gpus": args.ngpu,
        "nccl_version": args.nccl,
        "ranks": args.ranks,
        "seconds": args.seconds,
        "passed": failed == 0 and bool(rows),
        "suites": rows,
        "faults": faults,
        "traffic": traffic,
        "runs": runs,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    md = [
        f"# GPU verification, {summary['date']}",
        "",
        f"`{args.command}` on {args.ngpu} x {args.gpu}, NCCL {args.nccl}, {args.seconds} s: "
        + ("**all suites passed**" if summary["passed"] else f"**{failed} failed**"),
        "",
        "| layer | suite | ranks | passed | failed | max abs diff |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        diff = f"{r['max_abs_diff']:.2e}" if r["max_abs_diff"] is not None else "-"
        md.append(f"| {r['layer']} | {r['name']} | {r['ranks']} | {r['passed']} | {r['failed']} | {diff} |")
    if faults:
        md += ["", "| fault | ranks | mode | others raised after (s) | timeout + slack (s) |", "| --- | ---: | --- | ---: | ---: |"]
        for f_ in faults:
            after = f"{f_['raise_after_s']:.2f}" if f_["raise_after_s"] is not None else "-"
            md.append(f"| {f_['fault']} | {f_['ranks']} | {f_['mode']} | {after} | {f_['timeout_s']:.0f} + {f_['slack_s']:.0f} |")
    if traffic:
        md += [
            "",
            "Traffic per rank (distmuon-bench, gpt2-small, bf16 on the wire; the engine's own bytes beside the "
            "simulator's for the same plan, and the whole step's with FSDP's / DDP's collectives):",
            "",
            "| ranks | mode | engine bytes | predicted | step bytes | ortho GFLOP (max rank) | predicted |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for t in traffic:
            pb = f"{t['predicted_bytes_per_rank']:.4g}" if t["predicted_bytes_per_rank"] is not None else "-"
            pf = f"{t['predicted_ortho_flops_max_rank'] / 1e9:.2f}" if t["predicted_ortho_flops_max_rank"] is not None else "-"
            eb = f"{t['engine_comm_bytes_per_rank']:.4g}" if t["engine_comm_bytes_per_rank"] is not None else "-"
            md.append(
                f"| {t['ranks']} | {t['mode']} | {eb} | {pb} | {t['comm_bytes_per_rank']:.4g} | "
                f"{t['ortho_flops_max_rank'] / 1e9:.2f} | {pf} |"
            )
    failures = [f"- {r['layer']}/{r['name']} ({r['ranks']} ranks): {c}" for r in rows for c in r["failures"]]
    if failures:
        md += ["", "Failures:", *failures[:60]]
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

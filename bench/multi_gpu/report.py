"""Collects one multi-GPU run (the JSON files bench/multi_gpu/run.sh leaves in a folder) into one
results JSON and a markdown scaling table, with the planner's --simulate prediction beside each
measured optimizer step (prediction error = predicted / measured - 1).

    python bench/multi_gpu/report.py /tmp/mg --out results.json --md results.md
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re


def load(path: str):
    with open(path) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--md", required=True)
    args = ap.parse_args()
    rows, e2e = [], []
    # bench-W-D.json holds the modes run side by side; bench-W-D-MODE.json one mode run alone
    # (where the three did not fit in memory together).
    runs: dict[tuple[str, int], list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(args.folder, "bench-*.json"))):
        w, d, _ = re.match(r"bench-(.+)-(\d+)(?:-([a-z]+))?\.json", os.path.basename(path)).groups()
        runs.setdefault((w, int(d)), []).extend(load(path)["runs"])
    for (w, d), found in sorted(runs.items()):
        modes = {r["mode"]: r for r in found}
        row = {"workload": w, "world_size": d}
        for m in ("gather", "sharded", "dedicated"):
            if m in modes:
                row[f"{m}_ms"] = modes[m]["step_ms"]["median"]
                row[f"{m}_bytes_per_rank"] = modes[m].get("comm_bytes_per_rank")
        torch_path = os.path.join(args.folder, f"torch-{w}-{d}.json")
        if os.path.exists(torch_path):
            t = load(torch_path)["optimizer_step_ms"]
            row["fsdp2_adamw_ms"] = t.get("adamw")
            row["front_sharded_ms"] = t.get("distmuon")
        # plan-W-D.json: simulated from costs measured on the GPU; -analytic: from analytic rates.
        for tag in ("", "_analytic"):
            plan_path = os.path.join(args.folder, f"plan-{w}-{d}{tag.replace('_', '-')}.json")
            if not os.path.exists(plan_path):
                continue
            pts = [p for p in load(plan_path)["simulate"]["points"] if p["world"] == d]
            for m in ("gather", "sharded", "dedicated") if pts else ():
                row[f"{m}_predicted{tag}_ms"] = pts[0][m] * 1e3
                if row.get(f"{m}_ms"):
                    row[f"{m}_prediction{tag}_error"] = row[f"{m}_predicted{tag}_ms"] / row[f"{m}_ms"] - 1
        for m in ("sharded", "dedicated"):
            if row.get("gather_ms") and row.get(f"{m}_ms"):
                row[f"{m}_speedup_vs_gather"] = row["gather_ms"] / row[f"{m}_ms"]
            if row.get("fsdp2_adamw_ms") and row.get(f"{m}_ms"):
                row[f"{m}_over_adamw"] = row[f"{m}_ms"] / row["fsdp2_adamw_ms"]
        rows.append(row)
    for path in sorted(glob.glob(os.path.join(args.folder, "e2e-*.json"))):
        e2e.append(load(path))
    with open(args.out, "w") as f:
        json.dump({"optimizer_step": rows, "end_to_end": e2e}, f, indent=1)

    def fmt(v, spec=".1f"):
        return format(v, spec) if isinstance(v, (int, float)) else "—"

    def speedup(v):
        return f"{v:.2f}x" if isinstance(v, (int, float)) else "—"

    md = ["# Multi-GPU scaling (optimizer step, ms; in brackets distmuon-plan --simulate's prediction from "
          "costs measured on the GPU / from analytic rates)", "",
          "| workload | D | gather | sharded | dedicated | speed-up sharded / dedicated | FSDP2 AdamW | front sharded |",
          "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        cell = lambda m: (f"{fmt(r.get(m + '_ms'))} [{fmt(r.get(m + '_predicted_ms'))} / "  # noqa: E731
                          f"{fmt(r.get(m + '_predicted_analytic_ms'))}]")
        md.append(f"| {r['workload']} | {r['world_size']} | {cell('gather')} | {cell('sharded')} | {cell('dedicated')} | "
                  f"{speedup(r.get('sharded_speedup_vs_gather'))} / {speedup(r.get('dedicated_speedup_vs_gather'))} | "
                  f"{fmt(r.get('fsdp2_adamw_ms'))} | {fmt(r.get('front_sharded_ms'))} |")
    md += ["", "## End-to-end training step (forward + backward + optimizer)", "",
           "| D | HSDP | optimizer | fwd+bwd ms | optimizer ms | step ms | vs AdamW | peak GiB |",
           "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for run in e2e:
        for r in run["results"]:
            md.append(f"| {run['world_size']} | {run['replicate']}x{run['world_size'] // run['replicate']} | {r['optimizer']} | "
                      f"{fmt(r['fwd_bwd_ms'])} | {fmt(r['optimizer_ms'])} | {fmt(r['step_ms'])} | "
                      f"{fmt((r.get('step_over_adamw') or 0) * 100 - 100, '+.1f')} % | {fmt(r['peak_mem_gib'])} |")
    with open(args.md, "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()

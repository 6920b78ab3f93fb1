#!/usr/bin/env python3
"""Two builds' kernels side by side, from Nsight Compute CSVs of the same program (`bench/ab.sh
builds` writes them):

    ncu --kernel-name regex:K --metrics gpu__time_duration.sum,launch__registers_per_thread,\\
        sm__warps_active.avg.pct_of_peak_sustained_active,\\
        dram__throughput.avg.pct_of_peak_sustained_elapsed --csv --page raw ... > a.csv
    python3 bench/kernel_ab.py --steps 3 --label pi0 a.csv b.csv

Per kernel (template arguments dropped): launches and milliseconds per step, microseconds per
launch, registers per thread, achieved occupancy and DRAM throughput (launch means) for build A
and build B, and B's time over A's. Prints a Markdown table.
"""
import argparse
import collections
import re
import sys

from kernel_profile import MS_PER, read_table

METRICS = {
    "gpu__time_duration.sum": "us",
    "launch__registers_per_thread": "regs",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occ",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram",
}


def kernel(name: str) -> str:
    """`void distmuon::cuda::dev::muon_norm_kernel<true>(...)` -> `muon_norm_kernel`: template
    arguments dropped, so that a kernel matches across builds that made it a template or not
    (its variants are summed, their registers and occupancy averaged)."""
    base = name.split("(")[0].replace("void ", "").strip()
    base = re.sub(r"<.*>$", "", base)
    return re.sub(r"^.*::", "", base)


def read(path):
    """{kernel: [launches, sum us, sum regs, sum occ, sum dram]} of one CSV."""
    head, units, rows = read_table(path)
    if not rows:
        sys.exit(f"{path}: no kernel rows (did ncu profile anything?)")
    name_i = head.index("Kernel Name")
    cols = {key: head.index(m) for m, key in METRICS.items() if m in head}
    us_per = 1e3 * MS_PER.get(units[cols["us"]] or "nsecond", 1e-6)
    out = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for r in rows:
        try:
            vals = {k: float(r[i].replace(",", "")) for k, i in cols.items()}
        except ValueError:
            continue
        e = out[kernel(r[name_i])]
        e[0] += 1
        e[1] += vals.get("us", 0.0) * us_per
        e[2] += vals.get("regs", 0.0)
        e[3] += vals.get("occ", 0.0)
        e[4] += vals.get("dram", 0.0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--steps", type=int, default=1, help="steps the profiled program ran")
    ap.add_argument("--label", default="", help="heading of the table (the workload)")
    o = ap.parse_args()
    a, b = read(o.a), read(o.b)
    s = o.steps
    lines = [f"### {o.label}" if o.label else "", "",
             "| kernel | A launches/step | A ms/step | A us each | A regs | A occ % | A dram % "
             "| B launches/step | B ms/step | B us each | B regs | B occ % | B dram % | B / A |",
             "| --- " + "| ---: " * 13 + "|"]

    def cells(e):
        if not e:
            return ["-"] * 6
        n = e[0]
        return [f"{n / s:.1f}", f"{e[1] / 1e3 / s:.3f}", f"{e[1] / n:.1f}", f"{e[2] / n:.0f}",
                f"{e[3] / n:.1f}", f"{e[4] / n:.1f}"]

    ta = tb = 0.0
    for k in sorted(set(a) | set(b), key=lambda k: -max(a.get(k, [0, 0])[1], b.get(k, [0, 0])[1])):
        ea, eb = a.get(k), b.get(k)
        ta += ea[1] if ea else 0
        tb += eb[1] if eb else 0
        ratio = f"{eb[1] / ea[1]:.3f}" if ea and eb and ea[1] > 0 else "-"
        lines.append(f"| `{k}` | " + " | ".join(cells(ea) + cells(eb)) + f" | {ratio} |")
    lines.append(f"| all matched | | {ta / 1e3 / s:.3f} | | | | | | {tb / 1e3 / s:.3f} | | | | "
                 f"| {tb / ta if ta else 0:.3f} |")
    print("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

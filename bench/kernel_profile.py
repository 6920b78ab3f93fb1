#!/usr/bin/env python3
"""Where a step's device time goes, from Nsight Compute's per-kernel durations.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \\
        --print-kernel-base demangled \\
        distmuon-bench --backend cuda --workload gpt2-large --algo gram-ns \\
                       --no-adamw --warmup 1 --steps 2 > prof.csv
    python3 bench/kernel_profile.py prof.csv --steps 3 [--md out.md]

Kernels are grouped by what they do (their names are long template instantiations); --steps
divides the totals by the number of steps the program ran (warm-up included), so setup kernels
(random inputs) show up as their own group and can be read apart.
"""
import argparse
import collections
import csv
import re
import sys

# First match wins: (group, substrings that all must occur in the kernel name).
GROUPS = [
    # B row-major (N-major: stride (1, ld, batch)) tells the dense Q X from the symmetric A A^T.
    ("ours: masked dense Q X (sm90)", ("LowerTriangle", "cute::tuple<cute::C<1>, long, long>")),
    ("ours: symmetric product (sm90)", ("LowerTriangle",)),
    ("mirror (lower -> upper)", ("mirror",)),
    ("cuBLASLt / cuBLAS", ("nvjet",)),
    ("cuBLASLt / cuBLAS", ("gemm",)),
    ("cuBLASLt / cuBLAS", ("sm90_xmma",)),
    ("cuBLASLt / cuBLAS", ("cublas",)),
    ("norm / reductions", ("norm_kernel",)),
    ("momentum / update (fused elementwise)", ("dev::muon_",)),
    ("linear combinations", ("lincomb",)),
    ("AdamW", ("adam",)),
    ("convert / copy", ("convert",)),
    ("convert / copy", ("copy",)),
    ("plus identity / scaling", ("identity",)),
    ("random inputs (setup)", ("normal",)),
    ("random inputs (setup)", ("rand",)),
]


def group_of(name: str) -> str:
    low = name.lower()
    for g, keys in GROUPS:
        if all(k.lower() in low for k in keys):
            return g
    return "other"


def short(name: str) -> str:
    """CUTLASS names run to thousands of characters: keep what tells kernels apart."""
    if "LowerTriangle" in name:
        shapes = re.findall(r"cute::tuple<cute::C<(\d+)>, cute::C<(\d+)>, cute::C<(\d+)> ?>", name)
        tile = next((t for t in shapes if int(t[0]) >= 64), None)  # not the cluster shape
        kind = "dense" if group_of(name).startswith("ours: masked") else "sym"
        pp = "pingpong" if "Pingpong" in name else "cooperative"
        return f"ours {kind} {'x'.join(tile) if tile else '?'} {pp}"
    return name[:110]


# ncu's time units, in milliseconds.
MS_PER = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
          "second": 1e3, "s": 1e3}


def read_table(path):
    """ncu's `--csv --page raw` output: (header, units row, one row per kernel launch). ncu prints
    its own log lines first; the CSV lines are the quoted ones."""
    with open(path, newline="") as f:
        rows = list(csv.reader(l for l in f if l.startswith('"')))
    if not rows:
        return [], [], []
    head = rows[0]
    # The units row: present when the first duration cell is not a number.
    dur_i = head.index("gpu__time_duration.sum") if "gpu__time_duration.sum" in head else None
    has_units = len(rows) > 1 and dur_i is not None and not rows[1][dur_i].replace(",", "").replace(".", "").isdigit()
    units = rows[1] if has_units else [""] * len(head)
    return head, units, rows[2:] if has_units else rows[1:]


def read(path):
    """[(kernel name, milliseconds)] per launch."""
    head, units, rows = read_table(path)
    if not head:
        return []
    name_i, dur_i = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    scale = MS_PER.get(units[dur_i] or "nsecond", 1e-6)
    out = []
    for r in rows:
        try:
            out.append((r[name_i], float(r[dur_i].replace(",", "")) * scale))
        except ValueError:
            continue
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=1, help="steps the profiled program ran")
    ap.add_argument("--md", help="also write the tables as Markdown here")
    ap.add_argument("--top", type=int, default=12, help="kernels listed one by one")
    a = ap.parse_args()
    ks = read(a.csv)
    if not ks:
        sys.exit(f"{a.csv}: no kernel rows (did ncu profile anything?)")
    by_group = collections.defaultdict(lambda: [0.0, 0])
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for n, ms in ks:
        for table, key in ((by_name, short(n)), (by_group, group_of(n))):
            table[key][0] += ms
            table[key][1] += 1
    total = sum(ms for _, ms in ks)
    lines = [f"{len(ks)} kernels, {total:.2f} ms in all, {total / a.steps:.2f} ms per step "
             f"({a.steps} steps)", "",
             "| group | ms per step | share | launches per step |", "| --- | ---: | ---: | ---: |"]
    for g, (ms, n) in sorted(by_group.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {g} | {ms / a.steps:.3f} | {ms / total:.1%} | {n / a.steps:.1f} |")
    lines += ["", "| kernel (CUTLASS: ours, product, tile; else the name's first 110 characters) | ms per step | launches per step | us each |",
              "| --- | ---: | ---: | ---: |"]
    for n, (ms, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[: a.top]:
        lines.append(f"| `{n[:110]}` | {ms / a.steps:.3f} | {c / a.steps:.1f} | {1e3 * ms / c:.1f} |")
    text = "\n".join(lines)
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

"""Summary of bench/ab.sh: per workload, the median eager and graph-replay step of arm A and of
arm B over the rounds, and B / A; with the host time of one step() call where the runs report
it. Usage: python3 bench/ab_summary.py OUT_DIR (reads its A-<round>.json and B-<round>.json)"""

import glob
import json
import os
import statistics
import sys

KINDS = (("eager", "distmuon_eager_ms"), ("graph", "distmuon_graph_ms"), ("host", "distmuon_host_ms"))


def main(out: str) -> None:
    runs: dict = {}  # (side, workload) -> {"eager": [...], "graph": [...], "host": [...]}
    for path in sorted(glob.glob(os.path.join(out, "[AB]-*.json"))):
        side = os.path.basename(path)[0]
        for w in json.load(open(path)).get("workloads", []):
            r = runs.setdefault((side, w["name"]), {k: [] for k, _ in KINDS})
            for k, field in KINDS:
                if field in w:
                    r[k].append(w[field])
    names = list(dict.fromkeys(n for _, n in runs))  # workloads in the order the runs list them
    kinds = [k for k, _ in KINDS if all(r[k] for r in runs.values())]
    head = [f"{s} {k} ms" if s != "B / A" else s for k in kinds for s in ("A", "B", "B / A")]
    print("| workload | " + " | ".join(head) + " | rounds |")
    print("| --- |" + " ---: |" * (len(head) + 1))
    for n in names:
        a, b = runs.get(("A", n)), runs.get(("B", n))
        if not a or not b:
            print(f"| {n} | missing in {'A' if not a else 'B'} |" + " |" * len(head))
            continue
        cells = []
        for k in kinds:
            ma, mb = statistics.median(a[k]), statistics.median(b[k])
            cells += [f"{ma:.2f}", f"{mb:.2f}", f"{mb / ma:.3f}"]
        print(f"| {n} | " + " | ".join(cells) + f" | {min(len(a['eager']), len(b['eager']))} |")


if __name__ == "__main__":
    main(sys.argv[1])

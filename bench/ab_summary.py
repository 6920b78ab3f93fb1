"""Summary of bench/ab_h200.sh: per workload, the median eager and graph-replay step of build A
and of build B over the rounds, and B / A. Usage: python3 bench/ab_summary.py OUT_DIR"""

import glob
import json
import os
import statistics
import sys


def main(out: str) -> None:
    runs: dict = {}  # (side, workload) -> {"eager": [...], "graph": [...]}
    for path in sorted(glob.glob(os.path.join(out, "[AB]-*.json"))):
        side = os.path.basename(path)[0]
        for w in json.load(open(path)).get("workloads", []):
            r = runs.setdefault((side, w["name"]), {"eager": [], "graph": []})
            r["eager"].append(w["distmuon_eager_ms"])
            r["graph"].append(w["distmuon_graph_ms"])
    names = list(dict.fromkeys(n for _, n in runs))  # workloads in the order the runs list them
    print("| workload | A eager ms | B eager ms | B / A | A graph ms | B graph ms | B / A | rounds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in names:
        a, b = runs.get(("A", n)), runs.get(("B", n))
        if not a or not b:
            print(f"| {n} | missing in {'A' if not a else 'B'} | | | | | | |")
            continue
        med = {k: (statistics.median(a[k]), statistics.median(b[k])) for k in ("eager", "graph")}
        cells = []
        for k in ("eager", "graph"):
            ma, mb = med[k]
            cells += [f"{ma:.2f}", f"{mb:.2f}", f"{mb / ma:.3f}"]
        print(f"| {n} | " + " | ".join(cells) + f" | {min(len(a['eager']), len(b['eager']))} |")


if __name__ == "__main__":
    main(sys.argv[1])

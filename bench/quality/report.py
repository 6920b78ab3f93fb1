"""Turns the raw study records (quality-lm.json, quality-vision.json) into a markdown report with
PNG plots: loss curves, the CacheMuon frontier, hit rate over training, residual vs alignment.

    python bench/quality/report.py --lm out/quality-lm.json --vision out/quality-vision.json \
        --out bench/results/quality/quality

The raw records stay out of the tree (bench/results/README.md); the report, the plots and a
summary JSON per study (write_summary()) are what a run keeps.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def median(xs):
    xs = sorted(x for x in xs if x is not None and not math.isnan(x))
    return xs[len(xs) // 2] if xs else math.nan


def steady(xs):
    """Drop the first 10 % (warm-up, autotuning, cache fills)."""
    return xs[len(xs) // 10:]


def summarize(study: dict) -> list[dict]:
    arms = study["arms"]
    best_of = max if study["meta"].get("kind") == "vision" else min
    rows = []
    for a in arms:
        flops = sum(a["ortho_flops"]) / max(1, len(a["ortho_flops"]))
        hits = [h for h in a["hit_rate"] if h is not None]
        rows.append({
            "label": a["label"], "arm": a["arm"], "final": a["final"],
            "best": best_of([v for v in a["val"] if v == v]) if any(v == v for v in a["val"]) else math.nan,
            "opt_ms": median(steady(a["opt_ms"])), "ortho_gflop": flops / 1e9,
            "hit_rate": sum(hits) / len(hits) if hits else None,
        })
    # FLOPs saved against fresh Gram NS, the same iteration without the cache (else auto's).
    fresh_rows = [r for r in rows if r["arm"] == "distmuon:algo=gram-ns"] or \
        [r for r in rows if r["arm"] == "distmuon:algo=auto"]
    base = fresh_rows[0]["ortho_gflop"] if fresh_rows else None
    for r in rows:
        r["flops_saved"] = (1 - r["ortho_gflop"] / base) if base and "distmuon" in r["arm"] else None
    return rows


def plot_curves(study: dict, ylabel: str, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in study["arms"]:
        ax.plot(a["steps"], a["val"], label=a["label"], lw=1.3)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_frontier(rows: list[dict], ylabel: str, path: str) -> None:
    """Best value of each arm (the LM overfits its small corpus late in training, so the best
    validation loss, not the last, is the quality reached) against FLOPs saved and time."""
    pts = [r for r in rows if "distmuon" in r["arm"] and "shadow" not in r["arm"] and r["best"] == r["best"]]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for r in pts:
        saved = r["flops_saved"] or 0.0
        a1.scatter(saved * 100, r["best"])
        a1.annotate(r["label"].replace("distmuon ", ""), (saved * 100, r["best"]), fontsize=7)
        a2.scatter(r["opt_ms"], r["best"])
        a2.annotate(r["label"].replace("distmuon ", ""), (r["opt_ms"], r["best"]), fontsize=7)
    a1.set_xlabel("orthogonalization FLOPs saved vs fresh Gram NS (%)")
    a2.set_xlabel("optimizer time per step (ms)")
    for a in (a1, a2):
        a.set_ylabel(ylabel)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_hits(study: dict, path: str, window: int = 50) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for a in study["arms"]:
        if "gamma" not in a["arm"]:
            continue  # cache off: its hit rate is 0 by definition
        h = [x if x is not None else math.nan for x in a["hit_rate"]]
        if not any(x == x for x in h):
            continue
        smooth = [sum(v for v in h[max(0, i - window):i + 1] if v == v) / max(1, sum(1 for v in h[max(0, i - window):i + 1] if v == v))
                  for i in range(len(h))]
        ax.plot(range(len(h)), smooth, label=a["label"])
    ax.set_xlabel("step")
    ax.set_ylabel(f"cache hit rate ({window}-step mean)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_residual_alignment(study: dict, path: str) -> bool:
    xs, ys = [], []
    for a in study["arms"]:
        for r, al in zip(a["residual"], a.get("align", [])):
            if r is not None and al is not None:
                xs.append(r)
                ys.append(al)
    if not xs:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(xs, ys, s=4, alpha=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("residual ||D D^T - I||_F / sqrt(m)")
    ax.set_ylabel("cos(cached update, fresh update)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_summary(study: dict, rows: list[dict], path: str) -> None:
    """What a recorded run keeps: every arm's table row and its validation curve (the per-step
    raw record stays out of the tree)."""
    curves = {a["arm"]: {"steps": a["steps"], "val": a["val"]} for a in study["arms"]}
    arms = [{**r, "val_curve": curves[r["arm"]]} for r in rows]
    with open(path, "w") as f:
        json.dump({"meta": study["meta"], "arms": arms}, f, indent=1)


def table(rows: list[dict], metric: str) -> str:
    out = [f"| arm | final {metric} | best {metric} | optimizer ms/step | ortho GFLOP/step | hit rate | FLOPs saved |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        hr = f"{r['hit_rate']:.2f}" if r["hit_rate"] is not None else "—"
        fs = f"{100 * r['flops_saved']:.1f} %" if r["flops_saved"] is not None else "—"
        out.append(f"| {r['label']} | {r['final']:.4f} | {r['best']:.4f} | {r['opt_ms']:.2f} | "
                   f"{r['ortho_gflop']:.2f} | {hr} | {fs} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lm")
    ap.add_argument("--vision")
    ap.add_argument("--out", required=True, help="output prefix (a .md and PNGs beside it)")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    md = ["# Training quality: Muon vs AdamW and the CacheMuon frontier", "",
          "Every arm starts from the same weights and sees the same batches in the same order. "
          "Optimizer time is the device time of `step()` alone. Arms marked (shadow) also run the fresh "
          "solve on every step to measure how well the cached update aligns with it: their trajectory is "
          "the plain arm's, their optimizer time is not the cache's.", ""]
    for path, kind, metric, better in ((args.lm, "lm", "val loss", "lower"), (args.vision, "vision", "test acc", "higher")):
        if not path:
            continue
        study = json.load(open(path))
        study["meta"]["kind"] = kind
        rows = summarize(study)
        write_summary(study, rows, f"{args.out}-{kind}-summary.json")
        base = os.path.basename(args.out)
        plot_curves(study, metric, f"{args.out}-{kind}-curves.png")
        plot_frontier(rows, f"best {metric}", f"{args.out}-{kind}-frontier.png")
        plot_hits(study, f"{args.out}-{kind}-hits.png")
        has_align = plot_residual_alignment(study, f"{args.out}-{kind}-align.png")
        md += [f"## {'Language model' if kind == 'lm' else 'Vision'} ({better} is better)", "",
               f"Command: `{study['meta'].get('command', 'see meta in ' + os.path.basename(path))}`", "",
               table(rows, metric), "",
               f"![curves]({base}-{kind}-curves.png)", f"![frontier]({base}-{kind}-frontier.png)",
               f"![hit rate]({base}-{kind}-hits.png)"]
        if has_align:
            md.append(f"![residual vs alignment]({base}-{kind}-align.png)")
        md.append("")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {args.out}.md")


if __name__ == "__main__":
    main()

"""Turns the raw study records (lm.py's, one per model size; vision.py's) into a markdown report
with PNG plots per study: validation curves, the frontier (final value against optimizer time and
against FLOPs per step), hit rate over training, residual vs alignment (shadow arms).

    python bench/quality/report.py --lm out/quality-lm-small.json out/quality-lm-medium.json \
        --out out/quality-study/quality

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


FRESH_ARM = "distmuon:algo=gram-ns"  # the same iteration with the cache off: the baseline of the cache arms
OVERFIT = 0.01  # an arm whose final value is worse than its best by more than this (relative) is flagged
# Issue 20's targets for the cache arms against fresh Gram NS: never slower; where >= 50 % of the
# FLOPs are saved, at most 0.65x its time and a final loss at most 1 % above its own.
TARGET_SAVED, TARGET_TIME, TARGET_LOSS = 0.5, 0.65, 0.01
# The seed's GPT-2 points (issue 43): gamma 15 saved 65 % of the orthogonalization FLOPs at a final
# loss of 3.096 against fresh's 3.037; gamma 2 tracked fresh with 13.6 % fewer FLOPs.
SEED_POINTS = ({"label": "seed GPT-2 γ=15", "flops_saved": 0.65, "final_vs_fresh": 3.096 / 3.037 - 1},
               {"label": "seed GPT-2 γ=2 (tracks fresh)", "flops_saved": 0.136, "final_vs_fresh": 0.0})


def by_arm(study: dict) -> dict[str, list[dict]]:
    """The records of each arm (one per seed), in the order the study ran them."""
    out: dict[str, list[dict]] = {}
    for a in study["arms"]:
        out.setdefault(a["arm"], []).append(a)
    return out


def inputs_identical(study: dict) -> bool | None:
    """Whether every arm of each seed started from the same weights and saw the same batches;
    None for records without digests (from before they were kept)."""
    if not all(a.get("batch_digest") and a.get("init_digest") for a in study["arms"]):
        return None
    seen: dict[int, set] = {}
    for a in study["arms"]:
        seen.setdefault(a.get("seed", 0), set()).add((a["init_digest"], a["batch_digest"]))
    return all(len(v) == 1 for v in seen.values())


def fresh_row(rows: list[dict]) -> dict | None:
    """The baseline of the cache arms: their own algorithm with the cache off (for
    "distmuon:algo=gram-ns:polar-express:gamma=2", "distmuon:algo=gram-ns:polar-express"), else
    fresh Gram NS, else auto (which runs Gram NS on the elongated shapes) in records without it."""
    own = {r["arm"].split(":gamma=")[0] for r in rows if ":gamma=" in r["arm"]}
    return next((r for r in rows if r["arm"] in own), None) or \
        next((r for r in rows if r["arm"] == FRESH_ARM), None) or \
        next((r for r in rows if r["arm"] == "distmuon:algo=auto"), None)


def hit_curve(recs: list[dict], steps: list[int]) -> dict | None:
    """A cache arm's hit rate over training: the mean over seeds and over the steps of each
    evaluation interval (ending at `steps`), or None for an arm without a cache."""
    if not any(h is not None for r in recs for h in r["hit_rate"]):
        return None
    out, lo = [], 0
    for hi in steps:
        xs = [h for r in recs for h in r["hit_rate"][lo:hi] if h is not None]
        out.append(sum(xs) / len(xs) if xs else None)
        lo = hi
    return {"steps": steps, "hit_rate": out}


def summarize(study: dict) -> list[dict]:
    """One row per arm, over its seeds: the mean final and best values (the spread is max - min
    over seeds), the median steady optimizer time, the mean FLOPs and hit rate."""
    higher = study["meta"].get("kind") == "vision"
    best_of = max if higher else min
    rows = []
    for arm, recs in by_arm(study).items():
        finals = [r["final"] for r in recs]
        bests = [best_of((v for v in r["val"] if v == v), default=math.nan) for r in recs]  # NaN: diverged
        # Worse than its best by more than OVERFIT at the end, on any seed: the final value is
        # then not the quality the arm reached.
        overfit = any((b - f if higher else f - b) > OVERFIT * abs(b) for f, b in zip(finals, bests))
        flops = [x for r in recs for x in r["ortho_flops"]]
        hits = [h for r in recs for h in r["hit_rate"] if h is not None]
        rows.append({
            "label": recs[0]["label"], "arm": arm, "seeds": [r.get("seed", 0) for r in recs],
            "final": sum(finals) / len(finals), "final_spread": max(finals) - min(finals) if all(f == f for f in finals) else math.nan,
            "best": sum(bests) / len(bests), "overfit": overfit,
            "opt_ms": median([x for r in recs for x in steady(r["opt_ms"])]),
            "ortho_gflop": sum(flops) / max(1, len(flops)) / 1e9,
            "hit_rate": sum(hits) / len(hits) if hits else None,
        })
    fresh = fresh_row(rows)
    groups = by_arm(study)
    fresh_by_seed = {f.get("seed", 0): f["final"] for f in groups[fresh["arm"]]} if fresh is not None else {}
    for r in rows:
        # Against fresh at the same seed (same weights and batches): mean and spread over seeds.
        paired = [a["final"] / fresh_by_seed[a.get("seed", 0)] - 1 for a in groups[r["arm"]]
                  if a.get("seed", 0) in fresh_by_seed]
        r["final_vs_fresh_seeds"] = paired or None
        r["devices"] = sorted({a.get("device") or "?" for a in groups[r["arm"]]})
        cache_or_fresh = fresh is not None and "distmuon" in r["arm"]
        r["flops_saved"] = 1 - r["ortho_gflop"] / fresh["ortho_gflop"] if cache_or_fresh and fresh["ortho_gflop"] else None
        r["time_vs_fresh"] = r["opt_ms"] / fresh["opt_ms"] if fresh is not None and fresh["opt_ms"] > 0 else None
        # Against fresh's mean over the same seeds (an arm run at fewer seeds, such as the extra arms).
        common = [a for a in groups[r["arm"]] if a.get("seed", 0) in fresh_by_seed]
        if common and len(common) < len(fresh_by_seed):
            ours = sum(a["final"] for a in common) / len(common)
            theirs = sum(fresh_by_seed[a.get("seed", 0)] for a in common) / len(common)
            r["final_vs_fresh"] = ours / theirs - 1
        else:
            r["final_vs_fresh"] = r["final"] / fresh["final"] - 1 if fresh is not None else None
    return rows


def mean_curve(recs: list[dict]) -> tuple[list[int], list[float]]:
    n = min(len(r["val"]) for r in recs)
    return recs[0]["steps"][:n], [sum(r["val"][i] for r in recs) / len(recs) for i in range(n)]


def plot_curves(study: dict, ylabel: str, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for recs in by_arm(study).values():
        ax.plot(*mean_curve(recs), label=recs[0]["label"], lw=1.3)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel + (" (mean over seeds)" if len(study["arms"]) > len(by_arm(study)) else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def marker(arm: str) -> str:
    """One marker per family: AdamW, torch.optim.Muon, fresh distmuon, residual, probes, staleness,
    back-off."""
    if arm.startswith("adamw"):
        return "^"
    if arm == "torch-muon":
        return "D"
    if "staleness" in arm:
        return "X"
    if "backoff" in arm:
        return "v"
    if "probes" in arm:
        return "P"
    return "s" if "gamma" in arm else "o"


def plot_frontier(rows: list[dict], ylabel: str, title: str, path: str) -> None:
    """Each arm's final value (bars: the spread over seeds) against its optimizer time per step
    and its orthogonalization FLOPs per step; the band is fresh Gram NS +- 1 %."""
    pts = [r for r in rows if "shadow" not in r["arm"] and r["final"] == r["final"]]
    fresh = fresh_row(rows)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 5.2))
    for ax, key in ((a1, "opt_ms"), (a2, "ortho_gflop")):
        for i, r in enumerate(pts):
            label = r["label"] + (" (final > best + 1 %)" if r["overfit"] else "")
            ax.errorbar(r[key], r["final"], yerr=r["final_spread"] / 2, fmt=marker(r["arm"]), color=f"C{i % 10}",
                        mfc="none" if r["overfit"] else None, capsize=2, label=label)
        if fresh is not None:
            ax.axhspan(fresh["final"] * (1 - TARGET_LOSS), fresh["final"] * (1 + TARGET_LOSS), color="0.88", zorder=0)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    a1.set_xlabel("optimizer time per step (ms, median)")
    a2.set_xlabel("orthogonalization GFLOP per step")
    fig.suptitle(title + (f"; grey: {fresh['label']} +- 1 %" if fresh else ""), fontsize=9)
    fig.legend(*a1.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_vs_fresh(rows: list[dict], title: str, path: str) -> bool:
    """The cache arms against fresh at the same seeds: final loss (%, mean; bars: the spread over
    seeds) against optimizer time (x fresh) and against the FLOPs saved, with issue 20's target
    region and the seed's two GPT-2 points (FLOPs only: it gives no time)."""
    fresh = fresh_row(rows)
    pts = [r for r in rows if fresh is not None and r["final_vs_fresh_seeds"] and r["flops_saved"] is not None
           and r["time_vs_fresh"] is not None and "shadow" not in r["arm"] and r["final"] == r["final"]]
    if len(pts) < 2:
        return False
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 5))
    for i, r in enumerate(pts):
        rel = [100 * x for x in r["final_vs_fresh_seeds"]]
        y, err = sum(rel) / len(rel), (max(rel) - min(rel)) / 2
        for ax, x in ((a1, r["time_vs_fresh"]), (a2, 100 * r["flops_saved"])):
            ax.errorbar(x, y, yerr=err, fmt=marker(r["arm"]), color=f"C{i % 10}", capsize=2, label=r["label"])
    for j, p in enumerate(SEED_POINTS):
        a2.plot(100 * p["flops_saved"], 100 * p["final_vs_fresh"], "*", ms=13, color=f"C{(len(pts) + j) % 10}",
                mec="k", label=p["label"])
    a1.add_patch(plt.Rectangle((0, -100), TARGET_TIME, 100 + 100 * TARGET_LOSS, color="g", alpha=0.08, zorder=0))
    a2.add_patch(plt.Rectangle((100 * TARGET_SAVED, -100), 100, 100 + 100 * TARGET_LOSS, color="g", alpha=0.08, zorder=0))
    for ax in (a1, a2):
        ax.axhline(0, color="0.5", lw=0.8)
        ax.axhline(100 * TARGET_LOSS, color="g", lw=0.8, ls="--")
        ax.set_ylabel("final val loss vs fresh, same seed (%)")
        ax.grid(alpha=0.3)
    ys = [100 * x for r in pts for x in r["final_vs_fresh_seeds"]] + [100 * p["final_vs_fresh"] for p in SEED_POINTS]
    pad = 0.1 * (max(ys) - min(ys)) + 0.5
    for ax in (a1, a2):
        ax.set_ylim(min(ys) - pad, max(ys) + pad)
    a1.axvline(1, color="0.5", lw=0.8)
    a1.set_xlim(0, max(1.3, 1.1 * max(r["time_vs_fresh"] for r in pts)))
    a2.set_xlim(min(-5, min(100 * r["flops_saved"] for r in pts) - 5), 100)
    a1.set_xlabel("optimizer time per step vs fresh (x; target <= 0.65, green)")
    a2.set_xlabel("orthogonalization FLOPs saved vs fresh (%; target: >= 50, green)")
    fig.suptitle(title + f": the cache against {fresh['label']}", fontsize=9)
    fig.legend(*a2.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_hits(study: dict, path: str, window: int = 50) -> bool:
    """The hit rate over training of each cache arm (its first seed)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for recs in by_arm(study).values():
        a = recs[0]
        if "gamma" not in a["arm"]:
            continue  # cache off: its hit rate is 0 by definition
        h = [x if x is not None else math.nan for x in a["hit_rate"]]
        if not any(x == x for x in h):
            continue
        smooth = [sum(v for v in h[max(0, i - window):i + 1] if v == v) / max(1, sum(1 for v in h[max(0, i - window):i + 1] if v == v))
                  for i in range(len(h))]
        ax.plot(range(len(h)), smooth, label=a["label"])
        drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel(f"cache hit rate ({window}-step mean)")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


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
    """What a recorded run keeps: every arm's table row, its validation curve (mean over seeds)
    and a cache arm's hit rate per evaluation interval; the per-step raw record stays out of the
    tree."""
    groups = by_arm(study)
    arms = []
    for r in rows:
        steps, val = mean_curve(groups[r["arm"]])
        arms.append({**r, "val_curve": {"steps": steps, "val": val}, "hit_curve": hit_curve(groups[r["arm"]], steps)})
    with open(path, "w") as f:
        json.dump({"meta": study["meta"], "inputs_identical": inputs_identical(study), "seed_points": SEED_POINTS,
                   "arms": arms}, f, indent=1)


def target_lines(rows: list[dict]) -> list[str]:
    """The cache arms against issue 20's targets (LM studies: a lower loss is better)."""
    cache = [r for r in rows if "gamma" in r["arm"] and "shadow" not in r["arm"] and r["time_vs_fresh"] is not None]
    if not cache:
        return []
    slower = [f"{r['label']} ({r['time_vs_fresh']:.2f}x)" for r in cache if r["time_vs_fresh"] > 1]
    out = ["Targets (issue 20) for the cache arms against fresh (the same algorithm, the cache off):", "",
           "- no slower than fresh: " + ("met" if not slower else "**not met** by " + ", ".join(slower))]
    big = [r for r in cache if r["flops_saved"] is not None and r["flops_saved"] >= TARGET_SAVED]
    for r in big:
        ok = r["time_vs_fresh"] <= TARGET_TIME and r["final_vs_fresh"] <= TARGET_LOSS
        out.append(f"- {r['label']} saves {pct(r['flops_saved'])} of the FLOPs: time {r['time_vs_fresh']:.2f}x "
                   f"(target <= {TARGET_TIME}x), final loss {pct(r['final_vs_fresh'], True)} (target <= "
                   f"+{100 * TARGET_LOSS:g} %): " + ("met" if ok else "**not met**"))
    if not big:
        out.append(f"- no cache arm saves >= {100 * TARGET_SAVED:g} % of the FLOPs")
    return out + [""]


def pct(x: float | None, signed: bool = False) -> str:
    return "—" if x is None else f"{100 * x:{'+' if signed else ''}.1f} %"


def table(rows: list[dict], metric: str) -> str:
    out = [f"| arm | final {metric} | vs fresh | best {metric} | final > best + 1 % | optimizer ms/step | "
           "vs fresh | ortho GFLOP/step | FLOPs saved | hit rate |",
           "| --- | ---: | ---: | ---: | :---: | ---: | ---: | ---: | ---: | ---: |"]
    several = any(len(r["seeds"]) > 1 for r in rows)
    for r in rows:
        spread = f" ± {r['final_spread'] / 2:.4f}" if len(r["seeds"]) > 1 else \
            f" (seed {r['seeds'][0]})" if several else ""
        tf = f"{r['time_vs_fresh']:.2f}x" if r["time_vs_fresh"] is not None else "—"
        hr = f"{r['hit_rate']:.2f}" if r["hit_rate"] is not None else "—"
        out.append(f"| {r['label']} | {r['final']:.4f}{spread} | {pct(r['final_vs_fresh'], True)} | {r['best']:.4f} | "
                   f"{'**yes**' if r['overfit'] else 'no'} | {r['opt_ms']:.2f} | {tf} | {r['ortho_gflop']:.2f} | "
                   f"{pct(r['flops_saved'])} | {hr} |")
    return "\n".join(out)


def merge_runs(studies: list[dict]) -> dict:
    """One study from the raw records of several runs of one size (seeds or arms run in separate
    device calls): the arms of all runs, the seeds and commands of each, and the runs that some
    call left for a later one and none ran. An arm and seed recorded twice is refused rather
    than averaged twice."""
    merged = {"meta": dict(studies[0]["meta"]), "arms": []}
    seen: set = set()
    for s in studies:
        for a in s["arms"]:
            key = (a["arm"], a.get("seed", 0))
            if key in seen:
                raise SystemExit(f"report.py: arm {key[0]} seed {key[1]} is in two of the raw records")
            seen.add(key)
            merged["arms"].append(a)
    if len(studies) > 1:
        merged["meta"]["seeds"] = ",".join(str(x) for x in sorted({a.get("seed", 0) for a in merged["arms"]}))
        merged["meta"]["command"] = "`; `".join(s["meta"].get("command", "?") for s in studies)
    left = [r for s in studies for r in s["meta"].get("not_run", [])
            if (r.rsplit("@", 1)[0], int(r.rsplit("@", 1)[1])) not in seen]
    merged["meta"]["not_run"] = sorted(set(left))
    return merged


def load_lm(paths: list[str]) -> list[dict]:
    """The LM studies in the order their sizes first appear; records of one size are merged."""
    by_size: dict[str, list[dict]] = {}
    for path in paths:
        study = json.load(open(path))
        by_size.setdefault(study["meta"].get("size", path), []).append(study)
    return [merge_runs(v) for v in by_size.values()]


def study_section(study: dict, kind: str, out: str) -> list[str]:
    """Summary JSON, plots and the markdown of one study (an LM size or the vision study)."""
    study["meta"]["kind"] = kind
    meta = study["meta"]
    name = f"{kind}-{meta['size']}" if kind == "lm" and meta.get("size") else kind
    metric = "val loss" if kind == "lm" else "test acc"
    rows = summarize(study)
    write_summary(study, rows, f"{out}-{name}-summary.json")
    base = os.path.basename(out)
    plot_curves(study, metric, f"{out}-{name}-curves.png")
    model = f"{meta.get('layers')} x {meta.get('width')} GPT ({meta.get('data_label', 'tinyshakespeare, characters')})"
    title = name if kind != "lm" else f"{name}: {model}, {meta['steps']} steps"
    plot_frontier(rows, f"final {metric}", title, f"{out}-{name}-frontier.png")
    has_vs_fresh = kind == "lm" and plot_vs_fresh(rows, title, f"{out}-{name}-vs-fresh.png")
    has_hits = plot_hits(study, f"{out}-{name}-hits.png")
    has_align = plot_residual_alignment(study, f"{out}-{name}-align.png")
    if kind == "lm":
        heading = f"## Language model{', size ' + meta['size'] if meta.get('size') else ''} (lower is better)"
        setting = [model
                   + (f", {meta['params'] / 1e6:.2f} M parameters; {meta['train_tokens']:,} training "
                      f"tokens = {meta['epochs']:.2f} epochs; validation on {meta['val_tokens']} tokens"
                      if "epochs" in meta else "") + f"; seeds {meta.get('seeds', meta.get('seed', 0))}.", ""]
        devices = sorted({a.get("device") or "?" for a in study["arms"]})
        if devices != ["?"]:
            setting += [("Ran on " + devices[0] + "." if len(devices) == 1 else
                         "**Ran on several devices (" + ", ".join(devices) + "): optimizer times compare only "
                         "within one.**"), ""]
        if meta.get("not_run"):
            setting += [f"**Not run (left by a call's time budget): {', '.join(meta['not_run'])}.**", ""]
    else:
        heading, setting = "## Vision (higher is better)", []
    same = {True: "Every arm of a seed had the same initial weights and the same batches (digests equal).",
            False: "**Warning: the arms of a seed did not all see the same initial weights and batches.**",
            None: "The records keep no digests of the initial weights and batches."}[inputs_identical(study)]
    md = [heading, "", f"Command: `{meta.get('command', '(not recorded)')}`", "", *setting,
          same, "",
          table(rows, metric), "", *(target_lines(rows) if kind == "lm" else []),
          f"![curves]({base}-{name}-curves.png)", f"![frontier]({base}-{name}-frontier.png)"]
    if has_vs_fresh:
        md.append(f"![against fresh, with the seed's points]({base}-{name}-vs-fresh.png)")
    if has_hits:
        md.append(f"![hit rate]({base}-{name}-hits.png)")
    if has_align:
        md.append(f"![residual vs alignment]({base}-{name}-align.png)")
    return md + [""]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lm", nargs="*", default=[],
                    help="raw records of lm.py; several of one model size (seeds run apart) are merged")
    ap.add_argument("--vision")
    ap.add_argument("--out", required=True, help="output prefix (a .md and PNGs beside it)")
    args = ap.parse_args(argv)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    md = ["# Training quality: Muon vs AdamW and the CacheMuon frontier", "",
          "Every arm of a seed starts from the same weights and sees the same batches in the same order. "
          "The measure is the final validation value (mean over seeds, ± half the spread); an arm whose "
          "final is worse than its best by more than 1 % is flagged. Optimizer time is the device time of "
          "`step()` alone (median over steps after the first 10 %); 'vs fresh' compares with fresh Gram NS "
          "(`distmuon gram-ns`; where the cache arms run another algorithm, such as Polar Express's "
          "coefficients, that algorithm), the cache off. Arms marked (shadow) also run the fresh solve on every step "
          "to measure how well the cached update aligns with it: their optimizer time is not the cache's.", ""]
    for study in load_lm(args.lm):
        md += study_section(study, "lm", args.out)
    if args.vision:
        md += study_section(json.load(open(args.vision)), "vision", args.out)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"wrote {args.out}.md")


if __name__ == "__main__":
    main()

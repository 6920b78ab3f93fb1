#!/usr/bin/env python3
"""Merges distmuon-cuda-bench, distmuon-bench and torch baseline JSON into <date>-h200.json and a
markdown table beside it (bench/run_h200.sh copies them to $OUT/report.{json,md})."""
import argparse
import datetime
import json
import os


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", required=True)
    ap.add_argument("--torch", required=True)
    ap.add_argument("--tool", nargs="*", default=[], help="distmuon-bench --json outputs")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--command", default="bench/run_h200.sh full")
    ap.add_argument("--suffix", default="", help="appended to the file names, e.g. -cache")
    args = ap.parse_args()
    cb = json.load(open(args.cuda))
    tb = {w["name"]: w for w in json.load(open(args.torch))["workloads"]} if os.path.exists(args.torch) else {}
    tool = {}
    for p in args.tool:
        if os.path.exists(p):
            j = json.load(open(p))
            name = j["workload"] + (f"-{j['layers']}-layers" if j.get("layers") else "")
            tool[name] = {r["algo"]: r["step_ms"]["median"] for r in j["runs"]}
    date = datetime.date.today().isoformat()
    cache = cb.get("cache", {})
    hit = cache.get("hit_qwen_mlp", {})
    res = {"date": date, "device": cb.get("device"), "command": args.command,
           "gemm_tflops": cb.get("gemm_tflops"), "copy_tbps": cb.get("copy_tbps"),
           "syrk_over_dense": cb.get("syrk_over_dense"), "micro": cb.get("micro"),
           # the default (exact, Gram-space) residual; the probe residual's beside it
           "cache_hit_over_fresh": hit.get("cache_hit_over_fresh"),
           "cache_hit_over_fresh_probe": hit.get("probe", {}).get("hit_over_fresh"), "cache": cache,
           "workloads": []}
    # Workloads the torch baselines ran but the CUDA bench did not finish keep their baselines.
    done = {w["name"] for w in cb.get("workloads", [])}
    missing = [{"name": n, "distmuon_graph_ms": None, "distmuon_eager_ms": None, "floor_ms": None,
                "classes": []} for n in tb if n not in done]
    for w in cb.get("workloads", []) + missing:
        t = tb.get(w["name"], {})
        ran = [v for v in (w["distmuon_graph_ms"], w["distmuon_eager_ms"]) if v is not None]
        best = min(ran) if ran else None
        e = {"name": w["name"], "distmuon_ms": best, "distmuon_eager_ms": w["distmuon_eager_ms"],
             "distmuon_graph_ms": w["distmuon_graph_ms"], "floor_ms": w["floor_ms"], "floor_tuned_ms": w.get("floor_tuned_ms"),
             "torch_muon_ms": t.get("torch_muon_ms"), "adamw_ms": t.get("adamw_ms"),
             "adamw_full_model_ms": t.get("adamw_full_model_ms"),
             # dion's Muon in its CUDA-graph wrapper: Triton kernels, Gram Newton-Schulz kernels
             "dion_ms": t.get("dion_ms"), "dion_gns_ms": t.get("dion_gns_ms"),
             # measured on qwen's MLP shapes (the qwen workload's largest class)
             "cache_hit_over_fresh": hit.get("cache_hit_over_fresh") if w["name"].startswith("qwen") else None,
             "distmuon_bench_ms": tool.get(w["name"]), "classes": w["classes"],
             # the step() call's host time (the engine's graphs replay from its second step)
             "distmuon_host_ms": w.get("distmuon_host_ms"),
             # counted FLOPs of the algorithms the engine ran, per second of the step
             "effective_tflops": (w["tuned_flops"] / (best * 1e-3) / 1e12
                                  if best and w.get("tuned_flops") else None)}
        res["workloads"].append(e)
    # `auto` against the fastest single algorithm, per workload that distmuon-bench ran with them.
    res["auto_vs_best"] = []
    for name, by_algo in tool.items():
        singles = {a: v for a, v in by_algo.items() if a in ("ns5", "ns5-sym", "gram-ns")}
        if "auto" in by_algo and singles:
            fastest = min(singles, key=singles.get)
            res["auto_vs_best"].append({"name": name, "auto_ms": by_algo["auto"], "best": fastest,
                                        "best_ms": singles[fastest],
                                        "auto_over_best": by_algo["auto"] / singles[fastest]})
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"{date}-h200{args.suffix}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=2)
    lines = [f"# distmuon on one H200, {date}", "",
             f"Command: `{args.command}`. Device: {res['device']}.", "",
             f"Dense bf16 GEMM {res['gemm_tflops']:.0f} TFLOP/s, copy {res['copy_tbps']:.2f} TB/s"
             + (f", X X^T 4096x16384 bf16 / cuBLAS dense = {res['syrk_over_dense']:.3f}."
                if res["syrk_over_dense"] is not None else " (no micro-benchmarks in this run)."), "",
             "| workload | distmuon ms (caller graph / step()) | host ms of step() | counted TFLOP/s | "
             "distmuon-bench auto ms | floor ms | x floor | floor, tuned algos | torch.optim.Muon ms | "
             "x faster | AdamW fused ms (same matrices / whole model) | x AdamW |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in res["workloads"]:
        d = e["distmuon_ms"]
        tm, aw, awf = e["torch_muon_ms"], e["adamw_ms"], e["adamw_full_model_ms"]
        f = lambda v, fmt="{:.2f}": "-" if v is None else fmt.format(v)
        cli = (e.get("distmuon_bench_ms") or {}).get("auto")
        ok = d is not None
        lines.append(f"| {e['name']} | {f(e['distmuon_graph_ms'])} / {f(e['distmuon_eager_ms'])} | "
                     f"{f(e['distmuon_host_ms'], '{:.3f}')} | {f(e['effective_tflops'], '{:.0f}')} | "
                     f"{f(cli)} | {f(e['floor_ms'])} | {f(d / e['floor_ms'] if ok else None)} | "
                     f"{f(e.get('floor_tuned_ms'))} | {f(tm)} | "
                     f"{f(None if tm is None or not ok else tm / d, '{:.1f}')} | {f(aw)} / {f(awf)} | "
                     f"{f(None if aw is None or not ok else d / aw)} / "
                     f"{f(None if awf is None or not ok else d / awf)} |")
    dion = [e for e in res["workloads"] if e.get("dion_ms") or e.get("dion_gns_ms")]
    if dion:
        f = lambda v: "-" if v is None else f"{v:.2f}"
        lines += ["", "dion's Muon (its CUDA-graph wrapper; fp32, same matrices), ms per step:", "",
                  "| workload | distmuon | dion, Triton kernels | dion, Gram Newton-Schulz kernels | "
                  "dion's best / distmuon |", "|---|---|---|---|---|"]
        for e in dion:
            best = min(v for v in (e.get("dion_ms"), e.get("dion_gns_ms")) if v is not None)
            d = e["distmuon_ms"]
            lines.append(f"| {e['name']} | {f(d)} | {f(e.get('dion_ms'))} | {f(e.get('dion_gns_ms'))} | "
                         f"{f(best / d if d else None)} |")
    if res["auto_vs_best"]:
        lines += ["", "`auto` against the fastest single algorithm (distmuon-bench, median step ms):", "",
                  "| workload | auto | fastest of ns5 / ns5-sym / gram-ns | auto / fastest |",
                  "|---|---|---|---|"]
        for a in res["auto_vs_best"]:
            lines.append(f"| {a['name']} | {a['auto_ms']:.2f} | {a['best']} {a['best_ms']:.2f} | "
                         f"{a['auto_over_best']:.3f} |")
    if hit:
        lines += ["", f"CacheMuon on qwen2.5-7b's MLP shapes ({hit['count']} x {hit['m']}x{hit['n']}, "
                  f"{hit['algorithm']}): fresh solve {hit['fresh_ms']:.2f} ms."]
        for r in ("exact", "probe"):
            if r in hit:
                h = hit[r]
                lines.append(f"- {r} residual: hit {h['hit_ms']:.2f} ms = {h['hit_over_fresh']:.3f} x fresh "
                             f"(counted FLOPs {h['counted_flops_hit_over_fresh']:.3f}); every entry "
                             f"refreshing {h['refresh_ms']:.2f} ms = {h['refresh_over_fresh']:.3f} x fresh")
    eng = cache.get("engine_gpt2_small")
    if eng:
        lines += ["", f"gpt2-small engine steps, drift {eng['drift']} ({eng['steps']} steps):"]
        for k in ("cache_off", "cache_on", "cache_gamma15"):
            e = eng.get(k, {})
            extra = (f", hit rate {e['hit_rate']:.2f}, FLOPs saved {e['flops_saved_fraction']:.2f}"
                     if "hit_rate" in e else "")
            lines.append(f"- {k}: device {e.get('device_ms_median', 0):.3f} ms/step, host issue "
                         f"{e.get('host_issue_ms_mean', 0):.3f} ms/step, graph replay "
                         f"{e.get('graph_ms', 0):.3f} ms{extra}")
    lines += ["", "Algorithms per shape class (the engine's `auto`: tuned, restart set {2} kept; the "
              "tuner's fastest candidate beside it):", ""]
    for e in res["workloads"]:
        for c in e["classes"]:
            lines.append(f"- {e['name']} {c['count']} x {c['rows']}x{c['cols']}: {c.get('algorithm')} "
                         f"{c.get('restarts', '')} ({c.get('algo_ms', 0):.3f} ms, err vs fp32 "
                         f"{c.get('rel_err_vs_fp32', 0):.2e}); tuner fastest {c.get('tuner_fastest')}; "
                         f"{c.get('sym_kernels', {})}")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

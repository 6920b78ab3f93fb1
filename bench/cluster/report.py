"""Merges the one-GPU cluster's records (bench/cluster/run.sh) into cluster.json, cluster.md and
cluster.png, with the simulator's prediction of every measured step.

    python3 bench/cluster/report.py --out OUT [--plan build/bin/distmuon-plan] [--costs FILE]
    python3 bench/cluster/report.py --resimulate cluster.json --costs FILE --out DIR
    python3 bench/cluster/report.py --predict 2,4,8 --from-record cluster.json [--planner milp]
    (each takes --whole-gpu CLUSTER_JSON: whose D = 1 calibration to use where the record has none)

The prediction is `distmuon-plan --simulate` on the emulated machine: the cost table measured on
the whole GPU (OUT/costs.json or --costs) with each batch's work scaled by how much slower a
rank's part multiplies (whole-GPU GEMM rate over the part's, both measured with every part busy;
the batch's fixed launch cost kept), the parts' copy bandwidth as memory bandwidth, their NCCL
all-gather and all-reduce bus bandwidths as the link and its reductions, and where recorded the
broadcast's and reduce's as the dedicated mode's and the all-to-all's as the sharded mode's
(each less the one collective's issue time the calibration's timing includes), the calibrated
host time per collective (nccl_collective_us; --collective-latency-us where the calibration
lacks it), the bench's buckets, and where ranks share a GPU under MPS the share of a rank's
compute a transfer takes (--comm-compute-share). Nothing is fitted to the steps. --resimulate
predicts again the steps of an existing cluster.json (its calibration, its recorded predictions
beside) into DIR/resimulated.{json,md}. --predict prints, before a run, what it should measure.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

MODES = ("gather", "sharded", "dedicated", "adamw")


# The calibration's rates of one part of the GPU (not of the links between parts).
PER_PART_RATES = ("gemm_tflops_per_rank_min", "copy_gbs_per_rank_min", "adamw_gbs_per_rank_min")


def fmt(v, f: str = "{:.1f}") -> str:
    """A table cell: '-' for a missing value."""
    return "-" if v is None else f.format(v)


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# The calibration times one collective of 256 MiB per rank, its issue included.
CALIBRATION_BYTES = 256 * 2**20


def issue_free_gbs(busbw_gbs: float, algo_factor: float, issue_us: float) -> float:
    """Bus bandwidth of a calibration collective without the host's issue time in its timing
    (time = factor * bytes / busbw; the issue is paid once per collective by the simulator)."""
    t = algo_factor * CALIBRATION_BYTES / (busbw_gbs * 1e9)
    return algo_factor * CALIBRATION_BYTES / max(t - issue_us * 1e-6, 0.5 * t) / 1e9


def wait_share(cal: dict, args: argparse.Namespace) -> float:
    """A waiting NCCL kernel's share of a rank's compute: --comm-wait-share when given, else the
    calibration's (runs since 2026-12-06), else 0."""
    if args.comm_wait_share is not None:
        return args.comm_wait_share
    return cal.get("nccl_wait_compute_share") or 0.0


def predict(plan: str, rec: dict, full: dict, costs: str, args: argparse.Namespace) -> dict | None:
    """Predicted step, engine and FSDP2 ms per mode for one record (None when the simulator cannot
    run). With a cost table measured on the whole GPU: its work scaled by the part's GEMM
    slow-down. Without it: the analytic costs at the part's calibrated GEMM rate and copy
    bandwidth (a roofline, which the kernels do not reach: the error then includes their
    distance from it)."""
    if not (plan and os.path.exists(plan)):
        return None
    d = rec["ranks"]
    cal, full_cal = rec.get("calibration"), full.get("calibration")
    if not cal or not full_cal:
        return None
    scale = full_cal["gemm_tflops_per_rank_min"] / cal["gemm_tflops_per_rank_min"]
    on_parts = d > 1 and rec.get("mechanism", "mps") == "mps"  # MPS: 1/D of the SMs each
    if costs and os.path.exists(costs):
        source = ["--costs", costs, "--costs-scale", f"{scale:.6g}"]
        if on_parts:
            source += ["--costs-parts", str(d)]
        # The owners as the run placed them: on analytic costs where its engines had no table.
        if rec.get("plan_analytic", True):
            source.append("--sim-plan-analytic")
    else:
        source = ["--analytic", "--tflops", f"{cal['gemm_tflops_per_rank_min']:.6g}"]
    issue_us = cal.get("nccl_collective_us") or args.collective_latency_us
    sim = [plan, "--workload", rec["workload"], "--layers", str(rec["layers"]), *source,
           "--simulate", "--world-size", str(d),
           "--gpus-per-node", str(d), "--sim-max-world", str(d), "--solver", rec["planner"],
           "--hbm-tbs", f"{cal['copy_gbs_per_rank_min'] / 1e3:.6g}",
           "--bucket-mb", f"{rec.get('bucket_mb', 32):.6g}",
           "--collective-latency-us", f"{issue_us:.6g}",
           "--local-collective-us", f"{args.local_collective_us:.6g}",
           "--comm-compute-share", f"{args.comm_compute_share if on_parts else 0:.6g}",
           "--comm-wait-share", f"{wait_share(cal, args) if on_parts else 0:.6g}"]
    # Runs recorded before the owners' batches spanned buckets (no 'batches_per_bucket' in the
    # record) cut them at the buckets' borders: simulate them so.
    if rec.get("batches_per_bucket", True):
        sim.append("--batches-per-bucket")
    # The sharded mode's all-to-alls in equal blocks on the communicator's windows, where the
    # calibration found them (DISTMUON_NCCL_CTA_POLICY=zero), at the rate it timed them there.
    if cal.get("nccl_alltoall_on_windows"):
        sim.append("--uniform-all-to-all")
    if getattr(args, "grouped_hop_share", None) is not None:
        sim += ["--grouped-hop-share", f"{args.grouped_hop_share:.6g}"]
    # The AdamW baseline's pass at its own rate, where the calibration timed it (since 2026-12-07).
    if cal.get("adamw_gbs_per_rank_min"):
        sim += ["--adamw-tbs", f"{cal['adamw_gbs_per_rank_min'] / 1e3:.6g}"]
    if d > 1:
        sim += ["--intra-gbs", f"{issue_free_gbs(cal['nccl_allgather_busbw_gbs'], d - 1, issue_us):.6g}",
                "--intra-reduce-gbs",
                f"{issue_free_gbs(cal['nccl_allreduce_busbw_gbs'], 2 * (d - 1) / d, issue_us):.6g}"]
        # The dedicated mode's rooted collectives, where the calibration timed them (since
        # 2026-12-06; bus bandwidth = bytes / time for both).
        for key, flag in (("nccl_broadcast_busbw_gbs", "--intra-broadcast-gbs"),
                          ("nccl_reduce_busbw_gbs", "--intra-root-reduce-gbs")):
            if cal.get(key):
                sim += [flag, f"{issue_free_gbs(cal[key], 1, issue_us):.6g}"]
        # The sharded mode's all-to-alls, where timed (bus bandwidth = (D-1)/D * bytes / time,
        # the bytes a rank sends to its peers, which is what the simulator charges them for).
        if cal.get("nccl_alltoall_busbw_gbs"):
            a2a = cal["nccl_alltoall_busbw_gbs"] * getattr(args, "alltoall_scale", 1.0)
            sim += ["--intra-alltoall-gbs", f"{issue_free_gbs(a2a, (d - 1) / d, issue_us):.6g}"]
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        r = subprocess.run(sim + ["--json", tmp.name], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"simulator failed for {rec['workload']} at {d}: {r.stderr.strip()[-300:]}",
                  file=sys.stderr)
            return None
        pts = [p for p in load(tmp.name)["simulate"]["points"] if p["world"] == d]
    if not pts:
        return None
    p = pts[0]
    fsdp = (p["fsdp_reduce_scatter"] + p["fsdp_all_gather"]) * 1e3
    return ({m: p[f"{m}_step"] * 1e3 for m in MODES}
            | {f"{m}_engine": p[f"{m}_engine"] * 1e3 for m in MODES}
            | {f"{m}_collectives": p["collectives"][m] for m in MODES}
            | {"fsdp": fsdp, "fsdp_collectives": p["collectives"]["fsdp"],
               "costs_scale": scale,
               "costs": "measured" if costs and os.path.exists(costs) else "analytic",
               "collective_us": issue_us})


def e2e_runs(out: str) -> list[dict]:
    """The end-to-end training runs of OUT/e2e-*.json (bench/multi_gpu/e2e_train.py), each with
    its step over AdamW's at the same D (the optimizers may come from runs of their own)."""
    e2e = []
    for p in sorted(glob.glob(os.path.join(out, "e2e-*.json"))):
        rec = load(p)
        for r in rec.get("results", []):
            e2e.append({"ranks": rec["world_size"], "optimizer": r["optimizer"],
                        "step_ms": r["step_ms"], "fwd_ms": r.get("fwd_ms"), "fwd_bwd_ms": r["fwd_bwd_ms"],
                        "optimizer_ms": r["optimizer_ms"], "loss": r["final_loss"],
                        "peak_mem_gib": r.get("peak_mem_gib"), "engine_peak_gib": r.get("engine_peak_gib"),
                        "engine_issue_ms": r.get("engine_issue_ms"),
                        "config": rec.get("config"),
                        "seq": rec.get("seq"), "gpu": rec.get("gpu")})
    adamw = {r["ranks"]: r["step_ms"] for r in e2e if r["optimizer"] == "adamw"}
    for r in e2e:
        r["step_over_adamw"] = r["step_ms"] / adamw[r["ranks"]] if r["ranks"] in adamw else None
    return e2e


def planned_on_analytic(runs: list[dict]) -> bool:
    """Whether a run's engines placed their owners on analytic costs: its runs' plan_costs say
    so; records made before they did planned so (no cost table in the engines' store under
    MPS)."""
    said = [r["plan_costs"] for r in runs if r.get("plan_costs")]
    return not said or any(s.startswith("analytic") for s in said)


def resimulate(args: argparse.Namespace) -> None:
    """Predicts the steps of a recorded cluster.json again, beside its measurements and the
    predictions it recorded."""
    rec_all = load(args.resimulate)
    cal = rec_all["calibration"]
    whole = whole_gpu_calibration(cal, args)
    planner = args.planner or "lpt"  # records made before runs carried theirs planned with LPT
    preds, rows = {}, []
    for r in rec_all["runs"]:
        # One prediction per simulated set-up (it covers every mode of that run).
        key = (r["workload"], r["layers"], r["ranks"], r.get("planner"), r.get("batches_per_bucket"),
               r.get("bucket_mb", 32))
        if key not in preds:
            # Records made before runs carried their planner and batching: --planner, and batches
            # cut at bucket borders (the engine then).
            rec = {"workload": r["workload"], "layers": r["layers"], "ranks": r["ranks"],
                   "planner": r.get("planner", planner),
                   "batches_per_bucket": r.get("batches_per_bucket", True),
                   "plan_analytic": r.get("plan_analytic", True),
                   "bucket_mb": r.get("bucket_mb", 32),
                   "calibration": cal.get(str(r["ranks"])),
                   "mechanism": "mps" if r["ranks"] > 1 else "whole-gpu"}
            preds[key] = predict(args.plan, rec, {"calibration": whole}, args.costs, args)
        p, m = preds[key], r["mode"]
        if not p:
            continue
        fsdp_measured = r["step_ms"] - r["engine_ms"]
        rows.append({"workload": r["workload"], "layers": r["layers"], "ranks": r["ranks"], "mode": m,
                     "planner": r.get("planner") or planner, "bucket_mb": r.get("bucket_mb", 32),
                     "step_ms": r["step_ms"], "engine_ms": r["engine_ms"],
                     "fsdp_ms": fsdp_measured if m != "dedicated" else None,
                     "recorded_predicted_ms": r.get("predicted_ms"),
                     "recorded_error": r.get("error"),
                     "predicted_ms": p[m], "error": p[m] / r["step_ms"] - 1,
                     "predicted_engine_ms": p[f"{m}_engine"],
                     # what the mode gains over gather's engine step, as the simulator sees it
                     "predicted_engine_x_gather": p["gather_engine"] / p[f"{m}_engine"],
                     "predicted_fsdp_ms": p["fsdp"] if m != "dedicated" else None,
                     "collectives": p[f"{m}_collectives"] + (p["fsdp_collectives"] if m != "dedicated" else 0),
                     "costs": p["costs"], "costs_scale": p["costs_scale"],
                     "collective_us": p["collective_us"]})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "resimulated.json"), "w") as f:
        json.dump({"source": args.resimulate, "costs": args.costs, "planner": planner,
                   "comm_compute_share": args.comm_compute_share,
                   "comm_wait_share": args.comm_wait_share,
                   "alltoall_scale": args.alltoall_scale,
                   "local_collective_us": args.local_collective_us,
                   "prediction": __doc__.split("\n\n")[2].replace("\n", " "), "runs": rows},
                  f, indent=1)
    lines = ["| workload | D | mode | step ms | recorded prediction | error | new prediction | error "
             "| engine ms: measured / predicted | engine x gather's, predicted | FSDP2 ms: measured / "
             "predicted | collectives |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        name = r["workload"] + (f" ({r['layers']} layers)" if r["layers"] else "")
        lines.append(f"| {name} | {r['ranks']} | {r['mode']} | {r['step_ms']:.1f} | "
                     f"{fmt(r['recorded_predicted_ms'])} | {fmt(r['recorded_error'], '{:+.0%}')} | "
                     f"{r['predicted_ms']:.1f} | {r['error']:+.0%} | {r['engine_ms']:.1f} / "
                     f"{r['predicted_engine_ms']:.1f} | {r['predicted_engine_x_gather']:.2f} | "
                     f"{fmt(r['fsdp_ms'])} / "
                     f"{fmt(r['predicted_fsdp_ms'])} | {r['collectives']} |")
    errs = [abs(r["error"]) for r in rows]
    old = [abs(r["recorded_error"]) for r in rows if r["recorded_error"] is not None]
    if errs:
        was = (f"recorded {sum(old) / len(old):.1%} (largest {max(old):.0%}), " if old
               else "none recorded, ")
        lines += ["", f"mean |error|: {was}new {sum(errs) / len(errs):.1%} (largest "
                  f"{max(errs):.0%})"]
    with open(os.path.join(args.out, "resimulated.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, os.path.join(args.out, "resimulated.png"))


def borrowed_whole_gpu(args: argparse.Namespace) -> dict | None:
    """The D = 1 calibration of the record --whole-gpu (else --from-record) names, if any: for
    records that measured D > 1 only."""
    src = args.whole_gpu or args.from_record
    return load(src).get("calibration", {}).get("1") if src else None


def whole_gpu_calibration(cals: dict, args: argparse.Namespace) -> dict:
    """The whole GPU's calibration, which scales the cost table to a part: the record's own D = 1,
    else the borrowed one; without either, a one-line error."""
    whole = cals.get("1") or borrowed_whole_gpu(args)
    if not whole:
        sys.exit("this record has no whole-GPU (D = 1) calibration: name a record that has one "
                 "with --whole-gpu CLUSTER_JSON")
    return whole


def predict_planned(args: argparse.Namespace) -> None:
    """Predicts, before a run, the steps run.sh will measure: every workload of --workloads at
    every D of --predict, from a recorded cluster.json's calibrations (a D it lacks takes the
    largest recorded D's, its GEMM rate and copy bandwidth per rank scaled by that D over this
    one; the on-chip NCCL bandwidth kept) and the cost table. Prints a markdown table."""
    rec = load(args.from_record)
    cals = {int(k): v for k, v in rec["calibration"].items()}
    whole = whole_gpu_calibration(rec["calibration"], args)
    costs = args.costs or os.path.join(os.path.dirname(args.from_record), "sim-calibration", "costs.json")
    print("| workload | D | gather | sharded | dedicated | adamw | calibration |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for d in (int(x) for x in args.predict.split(",")):
        if d in cals:
            cal, how = cals[d], "recorded"
        else:
            top = max(k for k in cals if k > 1)
            # A part's own rates scale with its share of the GPU; the links' do not.
            cal = {k: v * top / d if k in PER_PART_RATES else v for k, v in cals[top].items()}
            how = f"D = {top}'s scaled"
        cal = {k: v for k, v in cal.items() if k != "nccl_collective_us"}  # --collective-latency-us
        for spec in args.workloads.split():
            name, _, layers = spec.partition(":")
            r = {"ranks": d, "workload": name, "layers": int(layers or 0),
                 "planner": args.planner or "milp",
                 "calibration": cal, "mechanism": "mps",
                 "batches_per_bucket": args.batches_per_bucket, "bucket_mb": args.bucket_mb}
            p = predict(args.plan, r, {"calibration": whole}, costs, args)
            if p:
                print(f"| {name} | {d} | {p['gather']:.1f} | {p['sharded']:.1f} | "
                      f"{p['dedicated']:.1f} | {p['adamw']:.1f} | {how} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="",
                    help="the folder run.sh wrote (with --resimulate: where to write)")
    ap.add_argument("--plan", default="build/bin/distmuon-plan", help="distmuon-plan to simulate with")
    ap.add_argument("--costs", default="",
                    help="cost table measured on the whole GPU (default: OUT/costs.json if there)")
    ap.add_argument("--resimulate", default="", metavar="CLUSTER_JSON",
                    help="predict the runs of this cluster.json again (no step records needed)")
    ap.add_argument("--planner", default=None,
                    help="--predict: the planner to place the owners with (default milp, the engine's); "
                         "--resimulate: the one runs recorded without theirs used (default lpt)")
    ap.add_argument("--collective-latency-us", type=float, default=143,
                    help="host time per collective where the calibration lacks "
                         "nccl_collective_us (143: H100, two MPS ranks, 2026-12-06)")
    ap.add_argument("--local-collective-us", type=float, default=10,
                    help="host time per collective at one rank (10: H100, 2026-12-06)")
    ap.add_argument("--comm-compute-share", type=float, default=0.75,
                    help="MPS ranks: share of a rank's compute a transfer takes (0.75: a bf16 "
                         "GEMM beside a 1 GiB NCCL broadcast, H100, two MPS ranks, 2026-12-06)")
    ap.add_argument("--comm-wait-share", type=float, default=None,
                    help="MPS ranks: share of a rank's compute its NCCL kernel takes while it waits "
                         "for its peers (default: the calibration's nccl_wait_compute_share, else 0)")
    ap.add_argument("--alltoall-scale", type=float, default=1.0,
                    help="what if the all-to-all ran this many times its calibrated rate (the "
                         "sharded mode's transfers; 1: as calibrated)")
    ap.add_argument("--grouped-hop-share", type=float, default=None,
                    help="share of its hops' latency a collective pays after the first of its "
                         "group (default: the simulator's)")
    ap.add_argument("--predict", default="", metavar="D,...",
                    help="predict the steps of a run at these D before it runs (with --from-record, "
                         "--workloads; prints a table; --out is not written)")
    ap.add_argument("--from-record", default="", metavar="CLUSTER_JSON",
                    help="--predict: the cluster.json whose calibrations to use")
    ap.add_argument("--whole-gpu", default="", metavar="CLUSTER_JSON",
                    help="the record whose whole-GPU (D = 1) calibration to use where the one at "
                         "hand has none (a run that measured D > 1 only)")
    ap.add_argument("--workloads", default="gpt2-large:0 pi0:6 qwen2.5-7b:4 deepseek-v2-lite:1",
                    help="--predict: name:layers, as run.sh's WORKLOADS")
    ap.add_argument("--batches-per-bucket", action="store_true",
                    help="--predict: the owners' batches cut at bucket borders (the old engine)")
    ap.add_argument("--bucket-mb", type=float, default=1024,
                    help="--predict: MiB of full matrices per bucket (distmuon-bench --bucket-mb; 0: one)")
    args = ap.parse_args()
    if not args.alltoall_scale > 0:
        ap.error(f"--alltoall-scale must be positive (got {args.alltoall_scale})")
    if args.predict:
        if not args.from_record:
            ap.error("--predict needs --from-record CLUSTER_JSON")
        predict_planned(args)
        return
    if not args.out:
        ap.error("--out is required")
    if args.resimulate:
        resimulate(args)
        return
    steps = [load(p) for p in sorted(glob.glob(os.path.join(args.out, "step-*.json")))]
    if not steps:
        e2e = e2e_runs(args.out)
        if not e2e:
            sys.exit(f"no step-*.json or e2e-*.json in {args.out}")
        write_e2e_only(args.out, e2e)
        return
    by_key = {(s["workload"], s["ranks"]): s for s in steps}
    costs = args.costs or os.path.join(args.out, "costs.json")
    # The whole GPU's calibration scales the cost table to a part: this run's D = 1 steps, else
    # the borrowed one.
    earlier = borrowed_whole_gpu(args)
    runs, calibration = [], {}
    for s in sorted(steps, key=lambda s: (s["workload"], s["ranks"])):
        full = by_key.get((s["workload"], 1)) or ({"calibration": earlier} if earlier else {})
        s["plan_analytic"] = planned_on_analytic(s["runs"])
        pred = predict(args.plan, s, full, costs, args)
        if "calibration" in s:
            calibration.setdefault(str(s["ranks"]), s["calibration"])
        for r in s["runs"]:
            row = {"workload": s["workload"], "layers": s["layers"], "ranks": s["ranks"],
                   "planner": s.get("planner"), "batches_per_bucket": s.get("batches_per_bucket", True),
                   "plan_analytic": s["plan_analytic"], "bucket_mb": s.get("bucket_mb", 32),
                   "mode": r["mode"], "step_ms": r["step_ms"]["median"],
                   "engine_ms": r["engine_ms"]["median"],
                   # how long step() held the host (recorded since 2026-12-06)
                   "host_ms": r["host_ms"]["median"] if "host_ms" in r else None,
                   "predicted_ms": pred[r["mode"]] if pred else None,
                   "predicted_engine_ms": pred[f"{r['mode']}_engine"] if pred else None,
                   "compute_ms": r.get("compute_ms"), "comm_ms": r.get("comm_ms"),
                   "wait_ms": r.get("wait_ms"), "busiest_rank": r.get("busiest_rank"),
                   "comm_bytes_per_rank": r["comm_bytes_per_rank"],
                   "ortho_flops_max_rank": r["ortho_flops_max_rank"],
                   "speedup_vs_gather": r["speedup_vs_gather"]}
            if pred:
                row["costs_scale"] = pred["costs_scale"]
                row["costs"] = pred["costs"]
                row["error"] = row["predicted_ms"] / row["step_ms"] - 1
            runs.append(row)
    # Over gather's step (modes run in processes of their own, run.sh from D = 4 on, get it as
    # one process reports it), and the engine's part over gather's engine: FSDP2's own
    # collectives, in the step of gather, sharded and AdamW, overlap the backward pass in training.
    gather = {(r["workload"], r["ranks"]): r for r in runs if r["mode"] == "gather"}
    for r in runs:
        g = gather.get((r["workload"], r["ranks"]))
        if r["speedup_vs_gather"] is None and g:
            r["speedup_vs_gather"] = g["step_ms"] / r["step_ms"]
        r["engine_speedup_vs_gather"] = g["engine_ms"] / r["engine_ms"] if g else None
    e2e = e2e_runs(args.out)
    first = steps[0]
    out = {"mechanism": sorted({s["mechanism"] for s in steps}), "gpu": first["device"],
           "device_sms": first["device_sms"], "calibration": calibration, "runs": runs, "e2e": e2e,
           "step_definition": first["step_definition"],
           "breakdown_definition": first.get("breakdown_definition"),
           "prediction": __doc__.split("\n\n")[2].replace("\n", " ")}
    with open(os.path.join(args.out, "cluster.json"), "w") as f:
        json.dump(out, f, indent=1)

    lines = [f"# The one-GPU cluster: {first['device']}", "",
             "| workload | D | mode | step ms | x gather | engine ms | x gather's | host ms | "
             "predicted ms | error | busiest rank: compute / comm / wait ms |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in runs:
        lines.append(f"| {r['workload']} | {r['ranks']} | {r['mode']} | {r['step_ms']:.1f} | "
                     f"{fmt(r['speedup_vs_gather'], '{:.2f}')} | {r['engine_ms']:.1f} | "
                     f"{fmt(r['engine_speedup_vs_gather'], '{:.2f}')} | {fmt(r['host_ms'])} | "
                     f"{fmt(r['predicted_ms'])} | "
                     f"{fmt(r.get('error'), '{:+.0%}')} | {fmt(r['compute_ms'])} / "
                     f"{fmt(r['comm_ms'])} / {fmt(r['wait_ms'])} |")
    lines += ["", "| D | GEMM TFLOP/s per rank | total | copy GB/s per rank | total | "
              "NCCL all-gather GB/s | all-reduce | broadcast | reduce | all-to-all | "
              "waiting kernel's share |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for d, c in sorted(calibration.items(), key=lambda kv: int(kv[0])):
        rooted = " | ".join(fmt(c.get(k), f)  # recorded since 2026-12-06; all-to-all later
                            for k, f in (("nccl_broadcast_busbw_gbs", "{:.0f}"),
                                         ("nccl_reduce_busbw_gbs", "{:.0f}"),
                                         ("nccl_alltoall_busbw_gbs", "{:.0f}"),
                                         ("nccl_wait_compute_share", "{:.2f}")))
        lines.append(f"| {d} | {c['gemm_tflops_per_rank_min']:.0f} | {c['gemm_tflops_total']:.0f} | "
                     f"{c['copy_gbs_per_rank_min']:.0f} | {c['copy_gbs_total']:.0f} | "
                     f"{c['nccl_allgather_busbw_gbs']:.0f} | {c['nccl_allreduce_busbw_gbs']:.0f} | "
                     f"{rooted} |")
    lines += e2e_table(e2e)
    with open(os.path.join(args.out, "cluster.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(runs, os.path.join(args.out, "cluster.png"))


def e2e_table(e2e: list[dict]) -> list[str]:
    if not e2e:
        return []

    def issue(r: dict) -> str:
        return f" ({r['engine_issue_ms']:.1f})" if r.get("engine_issue_ms") is not None else ""

    lines = ["", "| D | optimizer | step ms | x AdamW | forward ms | fwd+bwd ms | optimizer ms (engines' "
                 "host issue) | loss | peak GiB (PyTorch / distmuon's engines) |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in e2e:
        lines.append(f"| {r['ranks']} | {r['optimizer']} | {r['step_ms']:.1f} | "
                     f"{fmt(r['step_over_adamw'], '{:.3f}')} | {fmt(r.get('fwd_ms'))} | {r['fwd_bwd_ms']:.1f} | "
                     f"{r['optimizer_ms']:.1f}{issue(r)} | {r['loss']:.4f} | {fmt(r.get('peak_mem_gib'))} / "
                     f"{fmt(r.get('engine_peak_gib'))} |")
    return lines


def write_e2e_only(out: str, e2e: list[dict]) -> None:
    """cluster.json and cluster.md of a run of the e2e stage alone (no optimizer-step records)."""
    gpu = next((r["gpu"] for r in e2e if r.get("gpu")), None)
    with open(os.path.join(out, "cluster.json"), "w") as f:
        json.dump({"mechanism": ["mps"] if any(r["ranks"] > 1 for r in e2e) else ["whole-gpu"],
                   "gpu": gpu, "runs": [], "e2e": e2e}, f, indent=1)
    lines = [f"# The one-GPU cluster, FSDP2 training: {gpu}"] + e2e_table(e2e)
    with open(os.path.join(out, "cluster.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(runs: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot", file=sys.stderr)
        return
    workloads = sorted({r["workload"] for r in runs})
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for m in MODES:
            pts = sorted((r["ranks"], r["step_ms"], r["predicted_ms"]) for r in runs
                         if r["workload"] == w and r["mode"] == m)
            if not pts:
                continue
            color = f"C{MODES.index(m)}"  # one color per mode in every panel
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=m)
            if all(p[2] is not None for p in pts):
                ax.plot([p[0] for p in pts], [p[2] for p in pts], "x:", color=color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks D (1/D of the GPU each)")
        ax.set_title(w)
    axes[0][0].set_ylabel("step ms (o measured, x predicted)")
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines() if not h.get_label().startswith("_")}
    axes[0][0].legend([handles[m] for m in MODES if m in handles], [m for m in MODES if m in handles], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

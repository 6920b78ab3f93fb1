#!/usr/bin/env python3
"""torch.optim.Muon, torch.optim.AdamW(fused=True) and dion's Muon on the Muon matrices of
each workload.

Same shapes as distmuon-cuda-bench (the workloads' Muon matrices, first K layers where asked),
fp32 parameters, random gradients, one GPU. torch.optim.Muon is host-bound, so it is timed
with wall clock around synchronised steps; AdamW with CUDA events. Also times fused AdamW on
the whole model (Muon matrices + the AdamW tensors) for reference. With --dion DIR (a checkout
of microsoft/dion, or the package tests/gpu/stage.sh stages with DION_REPO=...): dion's Muon in
its best single-GPU configurations, its CUDA-graph wrapper around the Triton Newton-Schulz
kernels (dion_ms) and, where `gram_newton_schulz` imports, around Dao-AILab's Gram
Newton-Schulz kernels (dion_gns_ms); both replayed graphs, timed with CUDA events and with wall
clock. Prints progress, writes JSON.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def load(name, layers):
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "workloads", name + ".json")) as f:
        w = json.load(f)
    muon, adamw = [], []
    for dst, key in ((muon, "muon"), (adamw, "adamw")):
        for e in w[key]:
            n = e["count"] if layers <= 0 else min(e["count"], layers)
            shape = tuple(e["shape"])
            if key == "muon" and len(shape) == 3:  # stacked experts: torch.optim.Muon takes 2D
                n, shape = n * shape[0], shape[1:]
            dst += [shape] * n
    return muon, adamw


def make(shapes, gen):
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02)
        p.grad = torch.randn(s, device="cuda", generator=gen) * 1e-3
        ps.append(p)
    return ps


def time_wall(step, warmup, steps):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        t.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(t)


def time_events(step, warmup, steps):
    for _ in range(warmup):
        step()
    t = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b))
    return statistics.median(t)


def time_dion(ps, dion_dir, gram, warmup, steps):
    """dion.Muon on `ps` inside dion.cuda_graph.CudaGraphOptimizer: (events ms, wall ms), or a
    string saying why it could not run."""
    if dion_dir not in sys.path:
        sys.path.insert(0, dion_dir)
    try:
        from dion import Muon as DionMuon
        from dion.cuda_graph import CudaGraphOptimizer

        if gram:
            import gram_newton_schulz  # noqa: F401  (dion imports it lazily; fail here, clearly)
        inner = DionMuon(ps, lr=0.02, mu=0.95, nesterov=True, weight_decay=0.0,
                         use_triton=not gram, use_gram_newton_schulz=gram)
        opt = CudaGraphOptimizer(inner, warmup_steps=2)
        # Compile, warm up and capture (dion's first steps take seconds), then replay.
        return time_events(opt.step, warmup, steps), time_wall(opt.step, 1, steps)
    except Exception as e:  # noqa: BLE001  (recorded, and the other baselines go on)
        return f"{type(e).__name__}: {e}"[:300]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="gpt2-small,gpt2-large,pi0,qwen2.5-7b:8")
    ap.add_argument("--json", default="torch_baselines.json")
    ap.add_argument("--muon-steps", type=int, default=3)
    ap.add_argument("--adamw-steps", type=int, default=10)
    ap.add_argument("--dion", default="", help="a microsoft/dion checkout: time its Muon too")
    ap.add_argument("--dion-steps", type=int, default=10)
    args = ap.parse_args()
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "workloads": []}
    if args.dion:
        stamp = os.path.join(args.dion, "REV")  # the staged package's commit (tests/gpu/stage.sh)
        rev = (open(stamp).read().strip() if os.path.exists(stamp) else
               subprocess.run(["git", "-C", args.dion, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip())
        out["dion"] = rev or "unknown commit"
    for spec in args.workloads.split(","):
        name, _, layers = spec.partition(":")
        layers = int(layers) if layers else 0
        muon_shapes, adamw_shapes = load(name, layers)
        gen = torch.Generator(device="cuda").manual_seed(0)
        res = {"name": name + (f"-{layers}-layers" if layers else "")}
        ps = make(muon_shapes, gen)
        opt = torch.optim.Muon(ps, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5,
                               weight_decay=0.0)
        res["torch_muon_ms"] = time_wall(opt.step, 1, args.muon_steps)
        print(f"[torch] {res['name']}: torch.optim.Muon {res['torch_muon_ms']:.2f} ms", flush=True)
        del opt
        opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
        res["adamw_ms"] = time_events(opt.step, 3, args.adamw_steps)
        print(f"[torch] {res['name']}: AdamW(fused) on the Muon matrices {res['adamw_ms']:.2f} ms",
              flush=True)
        del opt
        if args.dion:
            for key, gram in (("dion_ms", False), ("dion_gns_ms", True)):
                got = time_dion(ps, args.dion, gram, 4, args.dion_steps)
                if isinstance(got, str):
                    res[key.replace("_ms", "_error")] = got
                    print(f"[dion] {res['name']}: {key} not measured: {got}", flush=True)
                else:
                    res[key], res[key.replace("_ms", "_wall_ms")] = got
                    print(f"[dion] {res['name']}: {key} {got[0]:.2f} ms (wall {got[1]:.2f})",
                          flush=True)
                torch.cuda.empty_cache()
        ps += make(adamw_shapes, gen)
        opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
        res["adamw_full_model_ms"] = time_events(opt.step, 3, args.adamw_steps)
        print(f"[torch] {res['name']}: AdamW(fused) on the whole model "
              f"{res['adamw_full_model_ms']:.2f} ms", flush=True)
        del opt, ps
        torch.cuda.empty_cache()
        out["workloads"].append(res)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""torch.optim.Muon and torch.optim.AdamW(fused=True) on the Muon matrices of each workload.

Same shapes as distmuon-cuda-bench (the workloads' Muon matrices, first K layers where asked),
fp32 parameters, random gradients, one H200. torch.optim.Muon is host-bound, so it is timed
with wall clock around synchronised steps; AdamW with CUDA events. Also times fused AdamW on
the whole model (Muon matrices + the AdamW tensors) for reference. Prints progress, writes JSON.
"""
import argparse
import json
import os
import statistics
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="gpt2-small,gpt2-large,pi0,qwen2.5-7b:8")
    ap.add_argument("--json", default="torch_baselines.json")
    ap.add_argument("--muon-steps", type=int, default=3)
    ap.add_argument("--adamw-steps", type=int, default=10)
    args = ap.parse_args()
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "workloads": []}
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

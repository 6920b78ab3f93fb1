"""Optimizer step alone on a workload's shapes under FSDP2 (one process per GPU, torchrun): fused
AdamW on the sharded parameters, the baseline distmuon must match, and distmuon.torch.Muon on the
same DTensors (sharded mode). Random gradients; fp32 parameters; median over steps of the slowest
rank.

    torchrun --nproc-per-node 8 bench/multi_gpu/opt_step.py --workload qwen2.5-7b --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class Layer(nn.Module):
    """The tensors of one layer index of the workload (FSDP2 shards one Layer as a unit)."""

    def __init__(self, entries: list[tuple[str, list[int]]], device: torch.device):
        super().__init__()
        for name, shape in entries:
            self.register_parameter(name.replace(".", "_"), nn.Parameter(
                torch.randn(*shape, device=device) * 0.02))


def build(workload: dict, layers: int, device: torch.device, mesh) -> tuple[nn.Module, list[str]]:
    model = nn.Module()
    model.layers = nn.ModuleList()
    muon_names = []
    n = max(e["count"] for e in workload["muon"])
    n = min(n, layers) if layers else n
    for i in range(n):
        entries = [(e["name"], e["shape"]) for e in workload["muon"] + workload["adamw"] if e["count"] > i]
        layer = Layer(entries, device)
        muon_names += [f"layers.{i}.{e['name'].replace('.', '_')}" for e in workload["muon"] if e["count"] > i]
        fully_shard(layer, mesh=mesh)
        model.layers.append(layer)
    fully_shard(model, mesh=mesh)
    return model, muon_names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="gpt2-large")
    ap.add_argument("--layers", type=int, default=0, help="first K layer indices only (0: all)")
    ap.add_argument("--optimizers", default="adamw,distmuon")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    workload = json.load(open(os.path.join(ROOT, "workloads", f"{args.workload}.json")))
    results = {}
    for kind in args.optimizers.split(","):
        model, muon_names = build(workload, args.layers, device, mesh)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        if kind == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
        else:
            from distmuon.torch import Muon

            muon = set(muon_names)
            opt = Muon(list(model.named_parameters()), lr=0.02, muon_filter=lambda n, p: n in muon)
        times = []
        for i in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        # On the device: NCCL has no CPU tensors (gloo, on CPU ranks, takes either).
        med = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        results[kind] = med.item()
        if rank == 0:
            print(f"[{world} ranks] {args.workload}: {kind:10s} optimizer step {med.item():9.2f} ms", flush=True)
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"world_size": world, "workload": args.workload, "layers": args.layers,
                       "optimizer_step_ms": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

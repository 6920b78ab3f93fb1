#!/usr/bin/env python3
"""The dedicated runtime (distmuon.torch.dedicate) on one GPU against the plain optimizer: time
per training step of a GPT-2-small-sized model (12 x 768, block 256, batch 32, bf16 autocast),
every configuration in the same process, from the same initial weights on the same batches.

    python bench/dedicated.py                       # the recorded run (out/dedicated/)
    python bench/dedicated.py --steps 20 --layers 2 # a quick check of the script
    python bench/dedicated.py --device cpu --layers 2 --embd 64 --heads 2 --block 32 --batch 4 --steps 6
                                                    # the script's logic on a CPU (gloo)

Configurations (world size 1; a one-rank NCCL process group gives dedicate() its mesh):

    plain            distmuon.torch.Muon on the plain model (local mode)
    plain-2          the same again: the noise floor of the comparison
    dedicated        dedicate(all Muon matrices) + Muon with dedicate()'s defaults (at one rank:
                     overlap_step off, everything in step())
    dedicated-overlap  the same with overlap_step forced on (each layer's momentum and
                     orthogonalization start on a side stream as soon as backward delivers its
                     gradients: per-layer batches, which one rank has no transfer to hide behind)
    fsdp             fully_shard (world size 1) + Muon (sharded mode)
    dedicated+fsdp   dedicate, then fully_shard of the rest (ignored_params) + Muon

A step is forward + backward + optimizer step + zero_grad, timed with CUDA events and no host
synchronisation inside it. Configurations take turns in rounds of --round steps, so that clock
and thermal drift spread over all of them. Reported per configuration: median and interquartile
range of the step time, the ratio to `plain`, forward+backward and optimizer medians from a
separate split pass (synchronised between the parts), the losses' largest difference from
`plain` (the same arithmetic: 0 or bf16-level), and the peak memory.

Writes $OUT (default out/dedicated)/dedicated.json and summary.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from train_gpt import GPT, GPTConfig  # noqa: E402

from distmuon.torch import Muon, dedicate  # noqa: E402

CONFIGS = ("plain", "plain-2", "dedicated", "dedicated-overlap", "fsdp", "dedicated+fsdp")


def build(kind: str, init: dict[str, torch.Tensor], cfg: GPTConfig, mesh: Any, device: torch.device) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard

    model = GPT(cfg).to(device)
    model.load_state_dict(init)
    ignored: set[Any] = set()
    if kind.startswith("dedicated"):
        dm = dedicate(model, mesh, overlap_step=True if kind == "dedicated-overlap" else None)
        ignored = dm.ignored_params
    if kind.endswith("fsdp"):
        for block in model.blocks:
            fully_shard(block, mesh=mesh, ignored_params=ignored)
        fully_shard(model, mesh=mesh, ignored_params=ignored)
    opt = Muon(model, lr=0.02, momentum=0.95, weight_decay=0.0, adamw_lr=3e-3, adamw_betas=(0.9, 0.95), adamw_weight_decay=0.0)
    return model, opt


def batches(n: int, cfg: GPTConfig, batch: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        idx = torch.randint(0, cfg.vocab, (batch, cfg.block_size + 1), generator=g)
        out.append((idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)))
    return out


class Clock:
    """CUDA events on the GPU (no host synchronisation until read); wall time on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.t: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.t.append(ev)
        else:
            self.t.append(time.perf_counter())

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, a: int, b: int) -> float:
        if self.cuda:
            return float(self.t[a].elapsed_time(self.t[b]))
        return (self.t[b] - self.t[a]) * 1e3


class Run:
    def __init__(self, kind: str, model: torch.nn.Module, opt: Any, cuda: bool) -> None:
        self.kind, self.model, self.opt, self.cuda = kind, model, opt, cuda
        self.step_ms: list[float] = []
        self.fb_ms: list[float] = []
        self.opt_ms: list[float] = []
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, split: bool) -> None:
        c = Clock(self.cuda)
        c.mark()
        with torch.autocast("cuda" if self.cuda else "cpu", dtype=torch.bfloat16, enabled=self.cuda):
            loss = self.model(x, y)
        loss.backward()
        if split:
            c.sync()
            c.mark()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        c.mark()
        c.sync()
        if split:
            self.fb_ms.append(c.ms(0, 1))
            self.opt_ms.append(c.ms(1, 2))
        else:
            self.step_ms.append(c.ms(0, 1))
            self.losses.append(loss.item())


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--round", type=int, default=10, help="steps per configuration per round")
    ap.add_argument("--split-steps", type=int, default=10, help="synchronised split steps per configuration")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (checks the script)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "out" / "dedicated")))
    args = ap.parse_args()
    kinds = [k for k in args.configs.split(",") if k]
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("error: no GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1,))
    cfg = GPTConfig(vocab=65, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in GPT(cfg).state_dict().items()}
    data = batches(args.warmup + args.steps + args.split_steps, cfg, args.batch, device)
    runs = []
    for kind in kinds:
        model, opt = build(kind, init, cfg, mesh, device)
        runs.append(Run(kind, model, opt, cuda))
        print(f"built {kind}: modes {opt.dist_modes}", flush=True)
    t0 = time.time()
    for i in range(args.warmup):  # every configuration sees the same batches in the same order
        for r in runs:
            r.step(*data[i], split=False)
    for r in runs:
        r.step_ms.clear()
    done = 0
    while done < args.steps:  # rounds: the configurations take turns
        n = min(args.round, args.steps - done)
        for r in runs:
            for i in range(args.warmup + done, args.warmup + done + n):
                r.step(*data[i], split=False)
        done += n
    for r in runs:
        for i in range(args.warmup + args.steps, len(data)):
            r.step(*data[i], split=True)
    wall = time.time() - t0

    base = next((r for r in runs if r.kind == "plain"), runs[0])
    _, base_med, _ = quartiles(base.step_ms)
    rows = []
    for r in runs:
        q1, med, q3 = quartiles(r.step_ms)
        diff = max(abs(a - b) for a, b in zip(r.losses, base.losses))
        rows.append({
            "config": r.kind,
            "modes": r.opt.dist_modes,
            "step_ms_median": med,
            "step_ms_q1": q1,
            "step_ms_q3": q3,
            "ratio_to_plain": med / base_med,
            "fwd_bwd_ms_median": statistics.median(r.fb_ms),
            "optimizer_ms_median": statistics.median(r.opt_ms),
            "max_loss_diff_to_plain": diff,
            "final_loss": r.losses[-1],
            "stats": r.opt.stats(),
        })
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    params = sum(v.numel() for v in init.values())
    lines = [
        f"GPT {cfg.n_layer} x {cfg.n_embd}, {params / 1e6:.1f} M parameters, block {cfg.block_size}, batch "
        f"{args.batch}{', bf16 autocast' if cuda else ''}; "
        f"{torch.cuda.get_device_name(0) if cuda else 'CPU'}, torch {torch.__version__}",
        f"{args.steps} timed steps per configuration after {args.warmup} warm-up, rounds of {args.round}; "
        f"{wall:.0f} s in all; peak memory {peak:.1f} GiB (all configurations together)",
        f"{'config':>17} {'step ms':>8} {'IQR':>15} {'/ plain':>8} {'fwd+bwd':>8} {'optimizer':>9} {'loss diff':>10}",
    ]
    for row in rows:
        lines.append(
            f"{row['config']:>17} {row['step_ms_median']:8.2f} {row['step_ms_q1']:7.2f}-{row['step_ms_q3']:<7.2f} "
            f"{row['ratio_to_plain']:8.3f} {row['fwd_bwd_ms_median']:8.2f} {row['optimizer_ms_median']:9.2f} "
            f"{row['max_loss_diff_to_plain']:10.2e}"
        )
    lines.append("(step: forward+backward+step, no synchronisation inside; fwd+bwd / optimizer: a separate "
                 "synchronised pass; loss diff: largest |loss - plain's loss| over the timed steps)")
    text = "\n".join(lines)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.txt").write_text(text + "\n")
    (args.out / "dedicated.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "results": rows, "peak_gib": peak}, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

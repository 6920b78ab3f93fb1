"""End-to-end training step (forward + backward + optimizer) of a Qwen2.5-sized model under FSDP2,
one process per GPU (torchrun): fused AdamW versus distmuon in sharded mode (unmodified FSDP2,
all-to-all to owners) and in dedicated mode (distmuon.torch.dedicate before fully_shard).

    torchrun --nproc-per-node 8 bench/multi_gpu/e2e_train.py --config qwen2.5-1.5b --seq 2048 \
        --optimizers adamw,distmuon-sharded,distmuon-dedicated,distmuon-gather[,distmuon-sharded-bf16wire,distmuon-dedicated-serial] \
        [--replicate 2] \
        --json out.json

Validated on CPU ranks with gloo: --device cpu --config tiny --seq 64.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(__file__))
from qwen_model import Qwen, QwenConfig  # noqa: E402


@dataclass(frozen=True)
class Kind:
    """What an --optimizers name sets up."""
    distmuon: bool = True
    dedicated: bool = False  # distmuon.torch.dedicate before fully_shard: whole matrices, one owner each
    overlap_step: bool | None = None  # dedicated: None is dedicate()'s default (on CUDA: on)
    dist_mode: str = "auto"
    wire_dtype: torch.dtype | None = None


OPTIMIZERS = {
    "adamw": Kind(distmuon=False),
    "distmuon-sharded": Kind(),
    "distmuon-dedicated": Kind(dedicated=True),
    # The owners' orthogonalization all in step(), not during backward: separates that work from
    # the transfers' cost in the timings.
    "distmuon-dedicated-serial": Kind(dedicated=True, overlap_step=False),
    # Every rank all-gathers and orthogonalizes every matrix (the baseline).
    "distmuon-gather": Kind(dist_mode="gather"),
    # The float32 shards' rows and updates travel in bfloat16.
    "distmuon-sharded-bf16wire": Kind(wire_dtype=torch.bfloat16),
}


def build(cfg: QwenConfig, name: str, mesh, device: torch.device, bf16: bool, bucket_mb: float | None):
    kind = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = Qwen(cfg).to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    ignored = set()
    if kind.dedicated:
        from distmuon.torch import dedicate

        ignored = set(dedicate(model, mesh, overlap_step=kind.overlap_step).ignored_params)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=ignored or None)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored or None)
    if device.type == "cuda":
        # The whole model was built on every rank before sharding: hand its cached blocks back, or
        # ranks that share one GPU keep D copies of them (eight ranks of qwen2.5-0.5b ran out of an
        # 80 GB GPU in their first backward).
        torch.cuda.empty_cache()
    named = list(model.named_parameters())
    if not kind.distmuon:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=device.type == "cuda")
    else:
        from distmuon.torch import Muon

        opt = Muon(named, lr=0.02, weight_decay=0.1, adamw_lr=3e-4, adamw_betas=(0.9, 0.95),
                   dist_mode=kind.dist_mode, wire_dtype=kind.wire_dtype, bucket_mb=bucket_mb)
    return model, opt


class ForwardTimer:
    """The forward's time without a synchronization between forward and backward (which would
    change what overlaps there): CUDA events on the GPU, read after the step's end."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self) -> None:
        if self.cuda:
            self.ev = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            self.ev[0].record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.ev[1].record()
        else:
            self.elapsed_ms = (time.perf_counter() - self.t0) * 1e3

    def ms(self) -> float:  # after the device has finished the forward
        return self.ev[0].elapsed_time(self.ev[1]) if self.cuda else self.elapsed_ms


def write_profile_summary(prof, path: str, device: torch.device, rows: int = 30) -> None:
    """The profiled steps' operators by host time and, on CUDA, by device time: what a trace holds,
    small enough to bring back from a device call. `optimizer.step` is the optimizer's own range."""
    table = prof.key_averages()
    with open(path, "w") as f:
        f.write(f"# rank 0, {prof.step_num} profiler steps (2 active), by host time\n")
        f.write(table.table(sort_by="cpu_time_total", row_limit=rows) + "\n")
        if device.type == "cuda":
            f.write("# by device time\n")
            f.write(table.table(sort_by="cuda_time_total", row_limit=rows) + "\n")


def run(kind: str, args, cfg: QwenConfig, mesh, device: torch.device) -> dict:
    if args.stall_s > 0:  # building (first NCCL use included) may hang too: say where
        faulthandler.dump_traceback_later(args.stall_s, repeat=True)
    model, opt = build(cfg, kind, mesh, device, bf16=device.type == "cuda", bucket_mb=args.bucket_mb)
    if dist.get_rank() == 0 and args.progress:
        # The GPU's free memory counts every rank's (ranks may share it): a run that will not fit
        # shows it here, before its first step.
        free = f", {torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB of the GPU free" if device.type == "cuda" else ""
        print(f"  {kind}: model built and sharded{free}", flush=True)
    gen = torch.Generator(device="cpu").manual_seed(1 + dist.get_rank())
    fw, fb, op, tot, iss = [], [], [], [], []
    fwd = ForwardTimer(device)
    prof = None
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # Two steps after the warm-up ones (at least one timed step follows the profiler's own).
        prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=max(args.warmup - 1, 0), warmup=1, active=2, repeat=1))
        prof.start()
    for step in range(args.warmup + args.steps):
        # A step that has not ended after --stall-s prints every thread's stack on every rank
        # (and again each --stall-s): a hang names its place instead of waiting for a watchdog.
        if args.stall_s > 0:
            faulthandler.dump_traceback_later(args.stall_s, repeat=True)
        if dist.get_rank() == 0 and args.progress:
            print(f"  {kind}: step {step + 1} of {args.warmup + args.steps}", flush=True)
        idx = torch.randint(0, cfg.vocab, (args.micro_batch, args.seq + 1), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd.start()
        # FSDP2's MixedPrecisionPolicy casts only the parameters it manages: dedicated matrices
        # (ignored_params) stay f32, and autocast casts them at each matmul. Every configuration
        # runs under it, so that all compute alike.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(idx[:, :-1], idx[:, 1:], loss_chunk=args.loss_chunk)
        fwd.stop()
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        with torch.profiler.record_function("optimizer.step"):  # a range in the trace (free without one)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if prof:
            prof.step()
        if step >= args.warmup:
            if hasattr(opt, "stats"):  # the engines' host time issuing the step (after the sync)
                iss.append(opt.stats()["issue_ms"])
            fw.append(fwd.ms())
            fb.append((t1 - t0) * 1e3)
            op.append((t2 - t1) * 1e3)
            tot.append((t2 - t0) * 1e3)
    faulthandler.cancel_dump_traceback_later()
    if prof:
        prof.stop()
        if dist.get_rank() == 0:
            os.makedirs(args.profile, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.profile, f"trace-{kind}.json"))
            write_profile_summary(prof, os.path.join(args.profile, f"summary-{kind}.txt"), device)
    # The step is as slow as the slowest rank.
    med = torch.tensor([statistics.median(x) for x in (fb, op, tot, fw)], dtype=torch.float64,
                       device=device)  # NCCL has no CPU tensors
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    out = {"optimizer": kind, "fwd_bwd_ms": med[0].item(), "optimizer_ms": med[1].item(),
           "step_ms": med[2].item(), "fwd_ms": med[3].item(), "peak_mem_gib": mem, "final_loss": loss.item()}
    # What distmuon's engines hold beside PyTorch's allocator (rank 0's; peak_mem_gib does not
    # count it): their momentum, stages, workspaces and communication buffers.
    if hasattr(opt, "stats"):
        out["engine_peak_gib"] = opt.stats()["memory_peak_bytes"] / 2**30
        # The engines' host time issuing a step (median over the timed steps, rank 0's): of the
        # optimizer's time, what the host spends on the engine's launches.
        out["engine_issue_ms"] = statistics.median(iss) if iss else None
    # Torch's FSDP2 keeps a model that ran forward alive past this (hooks held from C++), so
    # configurations run one after another here pile up their memory: bench/cluster/run.sh runs
    # one optimizer per process.
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen2.5-1.5b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--loss-chunk", type=int, default=0,
                    help="tokens per chunk of the loss, its logits recomputed in backward (0: whole)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--optimizers", default="adamw,distmuon-sharded,distmuon-dedicated")
    ap.add_argument("--bucket-mb", type=float, default=None,
                    help="distmuon's bucket of full matrices in MiB (default: the engine's, 1 GiB); "
                         "eight gather ranks on one 80 GB GPU need 64")
    ap.add_argument("--replicate", type=int, default=1, help="HSDP replicate degree (2D mesh)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default="",
                    help="folder for a chrome trace and an operator summary per optimizer (rank 0; two steps, "
                         "whose times then include the profiler's: time in a run of its own)")
    ap.add_argument("--json", default="")
    ap.add_argument("--stall-s", type=float, default=120,
                    help="print every rank's stacks when a step runs longer than this (0: never)")
    ap.add_argument("--progress", action="store_true", help="rank 0 says which step starts")
    args = ap.parse_args()
    unknown = [k for k in args.optimizers.split(",") if k not in OPTIMIZERS]
    if unknown:
        ap.error(f"unknown --optimizers {unknown}; choose from {', '.join(OPTIMIZERS)}")

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        # More ranks than GPUs (the one-GPU cluster under MPS, bench/cluster/run.sh): ranks share
        # the GPUs in blocks, which needs NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1.
        local = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        local = local * torch.cuda.device_count() // max(local_world, torch.cuda.device_count())
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    if args.replicate > 1:
        assert world % args.replicate == 0, "--replicate must divide the world size"
        mesh = init_device_mesh(device.type, (args.replicate, world // args.replicate),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    cfg = QwenConfig.named(args.config)
    results = []
    for kind in args.optimizers.split(","):
        r = run(kind, args, cfg, mesh, device)
        results.append(r)
        if rank == 0:
            print(f"[{world} ranks{' HSDP %dx%d' % (args.replicate, world // args.replicate) if args.replicate > 1 else ''}] "
                  f"{kind:20s} fwd {r['fwd_ms']:7.1f} ms  fwd+bwd {r['fwd_bwd_ms']:8.1f} ms  optimizer {r['optimizer_ms']:7.1f} ms  "
                  f"step {r['step_ms']:8.1f} ms  peak {r['peak_mem_gib']:.1f} GiB", flush=True)
    if rank == 0:
        base = next((r for r in results if r["optimizer"] == "adamw"), None)
        for r in results:
            r["step_over_adamw"] = r["step_ms"] / base["step_ms"] if base else None
        if args.json:
            with open(args.json, "w") as f:
                gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
                json.dump({"world_size": world, "replicate": args.replicate, "config": args.config,
                           "seq": args.seq, "micro_batch": args.micro_batch,
                           "loss_chunk": args.loss_chunk, "bucket_mb": args.bucket_mb,
                           "steps": args.steps,
                           "warmup": args.warmup, "gpu": gpu, "results": results}, f, indent=1)
    dist.destroy_process_group()
    # The interpreter's own teardown is skipped: torch's gloo worker threads abort a rank now
    # and then there ("terminate called without an active exception", pytorch/pytorch#179291),
    # after everything above is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

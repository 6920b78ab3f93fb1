#!/usr/bin/env python3
"""What the CPU communicator of distmuon.torch costs: the engine's collectives run over the
user's torch.distributed process group (gloo) through Python callbacks, or over MPI. Side by
side in one run on N ranks:

1. one collective: torch.distributed directly, the torch communicator (engine -> Python ->
   gloo), the MPI communicator (when the build has MPI and the run is under mpirun);
2. the optimizer step of FSDP2 training (the example's character GPT) with each communicator,
   and the single-process step for scale.

    mpirun --allow-run-as-root --oversubscribe -np 2 python3 bench/front_comm.py   # torch and MPI
    torchrun --nproc-per-node 2 bench/front_comm.py                               # torch only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from distmuon import _C  # noqa: E402
from distmuon.torch import Muon  # noqa: E402
from distmuon.torch._torch_comm import TorchCollectives  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))


def init() -> tuple[int, int]:
    if "OMPI_COMM_WORLD_RANK" in os.environ:  # under mpirun: torch's ranks are MPI's
        os.environ.setdefault("RANK", os.environ["OMPI_COMM_WORLD_RANK"])
        os.environ.setdefault("WORLD_SIZE", os.environ["OMPI_COMM_WORLD_SIZE"])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def timed(fn: Callable[[], None], reps: int) -> float:
    """Median microseconds of fn over reps, after a warm-up; ranks start together."""
    for _ in range(max(3, reps // 10)):
        fn()
    dist.barrier()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        xs.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(xs)


def communicators(world: int) -> dict[str, _C.Communicator]:
    rank = dist.get_rank()
    out = {
        "torch": _C.make_python_communicator(
            TorchCollectives(dist.group.WORLD, torch.device("cpu")), rank, world, "torch-gloo", list(range(world))
        )
    }
    if _C.mpi_available() and "OMPI_COMM_WORLD_RANK" in os.environ:
        out["mpi"] = _C.make_mpi_world()
    return out


def micro(world: int, comms: dict[str, _C.Communicator], sizes: list[int], reps: int) -> list[dict[str, object]]:
    rows = []
    for n in sizes:
        t = torch.ones(n)
        per = n // world
        counts, displs = [per] * world, [q * per for q in range(world)]
        send, recv = torch.ones(per * world), torch.empty(per * world)
        row: dict[str, object] = {"elements": n, "bytes": 4 * n}
        row["all_reduce_us"] = {"torch.distributed": timed(lambda: dist.all_reduce(t), reps)}
        row["all_to_all_us"] = {"torch.distributed": timed(lambda: dist.all_to_all_single(recv, send), reps)}
        for name, c in comms.items():
            row["all_reduce_us"][name] = timed(lambda c=c: c.all_reduce(t), reps)  # type: ignore[index]
            row["all_to_all_us"][name] = timed(  # type: ignore[index]
                lambda c=c: c.all_to_all_v(send, counts, displs, recv, counts, displs), reps
            )
        rows.append(row)
    return rows


def step_times(world: int, kinds: list[str], steps: int, cfg_kw: dict[str, int], batch: int) -> dict[str, float]:
    """Median optimizer-step milliseconds of FSDP2 training with each communicator."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from train_gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab=65, **cfg_kw)
    out: dict[str, float] = {}
    for kind in kinds + ["single"]:
        torch.manual_seed(0)
        model = GPT(cfg)
        if kind != "single":
            fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = Muon(model, lr=0.02, adamw_lr=3e-3, communicator=kind if kind != "single" else "auto",
                   dist_mode="local" if kind == "single" else "auto")
        gen = torch.Generator().manual_seed(dist.get_rank())
        xs = []
        for step in range(steps + 3):
            idx = torch.randint(0, cfg.vocab, (batch if kind != "single" else batch * world, cfg.block_size + 1), generator=gen)
            opt.zero_grad()
            model(idx[:, :-1].contiguous(), idx[:, 1:].contiguous()).backward()
            if kind != "single":
                dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            if step >= 3:
                xs.append((time.perf_counter() - t0) * 1e3)
        out[kind] = statistics.median(xs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,16384,1048576", help="float32 elements per collective")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rank, world = init()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    comms = communicators(world)
    rows = micro(world, comms, [int(s) for s in args.sizes.split(",")], args.reps)
    kinds = [k for k in ("torch", "mpi") if k in comms]
    steps = step_times(world, kinds, args.steps, {"n_layer": args.n_layer, "n_head": 4, "n_embd": args.n_embd, "block_size": 64}, args.batch_size)
    if rank == 0:
        print(f"{world} ranks, {torch.get_num_threads()} torch threads each; medians")
        for r in rows:
            for op in ("all_reduce_us", "all_to_all_us"):
                cells = "  ".join(f"{k} {v:9.1f}" for k, v in r[op].items())  # type: ignore[union-attr]
                print(f"{op[:-3]:>10} {r['bytes']:>9} B: {cells}  (us)")
        print("optimizer step (ms): " + "  ".join(f"{k} {v:.2f}" for k, v in steps.items()))
        if args.json:
            args.json.write_text(json.dumps({"world": world, "collectives": rows, "step_ms": steps}, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the NCCL ranks of test_gpu_distributed.py run: the scenarios of the gloo suites
(dist_scenarios.py, dedicated_scenarios.py) on CUDA, plus mixed precision.

Muon iterates in float32 (ns_dtype) in the arms compared tightly with one process; the arms
marked bf16 keep the CUDA default (bf16 Newton-Schulz) and, where named, run the forward under
bf16 autocast or FSDP2's MixedPrecisionPolicy (bf16 parameters, fp32 reduction).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import dedicated_scenarios as ds
import dist_scenarios as sc

FP32 = {"ns_dtype": torch.float32}
KW = {**sc.OPT_KW, **FP32}
DKW = {**ds.OPT_KW, **FP32}
CACHE_KW = {**sc.CACHE_KW, **FP32}


def _each(rank: int, arms: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, Any]:
    """Runs the arms in order, each guarded, saying on stderr which one starts (a hang names it).

    Between arms each rank collects the arm's optimizers, waits for their NCCL communicators'
    teardowns and empties torch's cache: the verification's lanes share one GPU, and the memory
    an arm let go must not be held through the next ones.
    """
    from distmuon import _C

    out = {}
    for name, fn in arms.items():
        print(f"[rank {rank} {time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)
        out[name] = sc.guarded(fn)
        gc.collect()
        t0 = time.monotonic()
        if not _C.wait_for_nccl_teardowns(5.0):  # bounded: a lane of its own must not slow down
            print(f"[rank {rank}] NCCL teardowns still in flight 5 s after {name}", file=sys.stderr)
        elif time.monotonic() - t0 > 1.0:
            print(f"[rank {rank}] NCCL teardowns after {name}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        in_flight, destroyed, aborted = _C.nccl_teardowns()
        print(f"[rank {rank}] after {name}: device {(total - free) / 2**30:.1f} GiB in use "
              f"(all processes), torch reserves {torch.cuda.memory_reserved() / 2**30:.2f}; "
              f"NCCL communicators let go: {destroyed} destroyed, {aborted} aborted, "
              f"{in_flight} in flight", file=sys.stderr, flush=True)
    return out


def world4(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    return _each(rank, {
        "fsdp": lambda: sc.run_train(rank, world, "fsdp", ckpt, kw=KW),
        "hsdp": lambda: sc.run_train(rank, world, "hsdp", kw=KW),
        "fsdp_cache": lambda: sc.run_train(rank, world, "fsdp", kw=CACHE_KW),
        "fsdp_bf16": lambda: sc.run_train(rank, world, "fsdp"),
        "fsdp_autocast": lambda: sc.run_train(rank, world, "fsdp", amp=True),
        "fsdp_mp": lambda: sc.run_train(rank, world, "fsdp_mp"),
        "ded_flat": lambda: ds.run_dedicated(rank, world, "fsdp", 1, True, kw=DKW),
        "ded_hsdp": lambda: ds.run_dedicated(rank, world, "hsdp", 1, True, kw=DKW),
        "ded_accum": lambda: ds.run_dedicated(rank, world, "fsdp", 2, False, kw=DKW),
        "ded_autocast": lambda: ds.run_dedicated(rank, world, "fsdp", 1, True, amp=True),
    })


def world2(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    return _each(rank, {
        "fsdp": lambda: sc.run_train(rank, world, "fsdp", kw=KW),
        "ddp": lambda: sc.run_train(rank, world, "ddp", kw=KW),
        "gather": lambda: sc.run_train(rank, world, "fsdp", dist_mode="gather", kw=KW),
        "resume2": lambda: sc.run_resume(rank, world, "fsdp", ckpt, kw=KW),
        "ded_plain": lambda: ds.run_dedicated(rank, world, "fsdp", 1, False, kw=DKW),
        "ded_overlap": lambda: ds.run_dedicated(rank, world, "fsdp", 1, True, kw=DKW),
        "ded_accum_overlap": lambda: ds.run_dedicated(rank, world, "fsdp", 2, True, kw=DKW),
    })


def world8(rank: int, world: int) -> dict[str, Any]:
    return _each(rank, {
        "fsdp": lambda: sc.run_train(rank, world, "fsdp", kw=KW),
        "hsdp": lambda: sc.run_train(rank, world, "hsdp", kw=KW),
        "ded_flat": lambda: ds.run_dedicated(rank, world, "fsdp", 1, True, kw=DKW),
    })

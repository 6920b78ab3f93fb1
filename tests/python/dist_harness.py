"""Launching real ranks for the distributed tests: processes started with torch.multiprocessing
(spawn), a process group over TCP on localhost, results returned through files. Two rigs: gloo
ranks on the CPU (the CI suite), or NCCL ranks on this machine's GPUs (test_gpu_distributed.py),
several per GPU where NCCL allows it (>= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1); NCCL ranks run
the scenarios on their CUDA device (helpers.scenario_device).

A rank that raises records the exception (type and message) as its result instead of dying, so
that tests can assert on errors raised on every rank. A launch that does not finish within its
deadline is killed and reported (never a hung test run).
"""

from __future__ import annotations

import datetime
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

Scenario = Callable[..., dict[str, Any]]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def device_of(rank: int, world: int) -> int:
    """The GPU of NCCL rank `rank`: ranks share the GPUs in blocks."""
    per_gpu = -(-world // torch.cuda.device_count())
    return rank // per_gpu


def _child(
    rank: int, world: int, port: int, out: str, target: Scenario, args: tuple[Any, ...], backend: str
) -> None:
    import faulthandler

    import torch.distributed as dist

    # A rank stuck in native code cannot raise: when a watchdog aborts it (torch's NCCL watchdog
    # after the process group's timeout) or the launcher finds the launch stuck (SIGUSR1, below),
    # every thread's Python stack goes to stderr.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ["DISTMUON_COMM_TIMEOUT_S"] = "60"  # a divergence fails in a minute, not five
    torch.set_num_threads(1)  # ranks share 2 cores
    device = None
    if backend == "nccl":
        torch.cuda.set_device(device_of(rank, world))
        os.environ["DISTMUON_TEST_DEVICE"] = "cuda"
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=90), device_id=device,
    )
    try:
        result: dict[str, Any] = target(rank, world, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the test, which decides
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    # Our objects go first, while the process group is alive (their destructors are tested
    # here, not skipped), then the groups. The interpreter's own teardown is skipped: torch's gloo
    # worker threads, still holding tensors there, abort a rank now and then ("terminate called
    # without an active exception", SIGABRT, once in a clean-clone run on CI's 2 cores;
    # pytorch/pytorch#179291) after its result is written.
    del result
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(
    world: int, target: Scenario, *args: Any, timeout_s: float = 300, backend: str = "gloo"
) -> list[dict[str, Any]]:
    """Runs target(rank, world, *args) on `world` ranks of `backend` ("gloo" or "nccl"); returns
    each rank's result dict."""
    for _ in range(3):
        try:
            return _launch_once(world, target, args, timeout_s, backend)
        except mp.ProcessRaisedException as e:
            # free_port() cannot hold its port until rank 0 listens on it: another process (a
            # concurrent test lane's communicators) may take it in between. Only that is retried.
            if "EADDRINUSE" not in str(e):
                raise
    return _launch_once(world, target, args, timeout_s, backend)


def _launch_once(
    world: int, target: Scenario, args: tuple[Any, ...], timeout_s: float, backend: str
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _child,
            args=(world, free_port(), out, target, args, backend),
            nprocs=world,
            join=False,
            start_method="spawn",
        )
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            while True:
                stuck = datetime.datetime.now() > deadline
                if stuck or any(p.exitcode not in (None, 0) for p in ctx.processes):
                    _dump_stacks(ctx.processes)  # before join() kills the ranks left
                if ctx.join(timeout=1.0):
                    break
                if stuck:
                    raise TimeoutError(f"{target.__name__} on {world} ranks did not finish in {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _dump_stacks(processes: list[Any]) -> None:
    """The stacks of the ranks still running when a launch fails or hangs, on stderr: Python's
    (SIGUSR1 -> faulthandler) and, where cuda-gdb is installed (GPU machines), the native ones,
    so that a rank stuck in a native call says which."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        os.kill(p.pid, signal.SIGUSR1)
    gdb = shutil.which("cuda-gdb") or next((x for x in ["/usr/local/cuda/bin/cuda-gdb"] if os.path.exists(x)), None)
    for p in alive if gdb else []:
        try:
            bt = subprocess.run(
                [gdb, "-p", str(p.pid), "-batch", "-ex", "thread apply all bt 20"],
                capture_output=True, text=True, timeout=60,
            ).stdout
        except subprocess.TimeoutExpired:
            bt = "(cuda-gdb did not answer in 60 s)"
        lines = [x for x in bt.splitlines() if x.startswith(("#", "Thread"))]
        print(f"---- native stacks of pid {p.pid}\n" + "\n".join(lines[:200]), file=sys.stderr, flush=True)


def ok(result: dict[str, Any]) -> dict[str, Any]:
    """A rank's result, asserting it holds no recorded exception (shown with its traceback)."""
    assert "error" not in result, result.get("traceback", result["error"])
    return result


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two name -> tensor maps with the same names."""
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)

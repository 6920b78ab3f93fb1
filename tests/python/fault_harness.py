"""Launching gloo ranks that may die (SIGKILL) or stall on purpose, and collecting what the
other ranks report.

Unlike dist_harness.launch, a rank writes its result as soon as it has one and leaves at once
(os._exit): no final barrier or process-group teardown, which would wait for a dead or stalled
peer. The parent waits until the ranks asked for have reported (or died), then kills the rest.
"""

from __future__ import annotations

import datetime
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from dist_harness import free_port

Scenario = Callable[..., dict[str, Any]]


def _child(rank: int, world: int, port: int, out: str, comm_timeout_s: float, target: Scenario, args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    os.environ["DISTMUON_COMM_TIMEOUT_S"] = str(comm_timeout_s)
    torch.set_num_threads(1)  # ranks share 2 cores
    # torch's own collectives (backward, checkpoints) wait longer than distmuon's: a dead peer
    # closes its connections (gloo fails at once), a stalled one is distmuon's to report.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        result: dict[str, Any] = target(rank, world, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the test, which decides
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    tmp = Path(out) / f"rank{rank}.tmp"
    torch.save(result, tmp)
    os.replace(tmp, Path(out) / f"rank{rank}.pt")
    os._exit(0)


def kill_self() -> None:
    """What a rank killed by the machine does: no handler, no cleanup."""
    os.kill(os.getpid(), signal.SIGKILL)


def launch(
    world: int,
    target: Scenario,
    *args: Any,
    report_from: Sequence[int],
    comm_timeout_s: float = 60,
    deadline_s: float = 300,
) -> list[dict[str, Any] | None]:
    """Runs target(rank, world, *args) on `world` ranks and waits until every rank of
    `report_from` has written its result or died; returns each rank's result (None: no result,
    e.g. killed). Ranks still running then are killed."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _child, args=(world, free_port(), out, comm_timeout_s, target, args), nprocs=world, join=False,
            start_method="spawn",
        )
        end = time.monotonic() + deadline_s
        try:
            while True:
                done = [(Path(out) / f"rank{r}.pt").exists() or not ctx.processes[r].is_alive() for r in report_from]
                if all(done):
                    break
                if time.monotonic() > end:
                    raise TimeoutError(f"{target.__name__}: ranks {list(report_from)} did not report in {deadline_s} s")
                time.sleep(0.1)
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        return [
            torch.load(Path(out) / f"rank{r}.pt", weights_only=False) if (Path(out) / f"rank{r}.pt").exists() else None
            for r in range(world)
        ]

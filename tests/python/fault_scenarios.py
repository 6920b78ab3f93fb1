"""What the ranks of test_faults.py run: a peer that stalls before step(), a peer killed
(SIGKILL) in the middle of a step or of a DCP checkpoint, and the resumption from the last
complete checkpoint. The training is dist_scenarios' (same model, batches and options)."""

from __future__ import annotations

import time
from typing import Any

import torch

import dist_scenarios as sc
from distmuon.torch import Muon
from distmuon.torch._torch_comm import TorchCollectives
from fault_harness import kill_self

STALL_S = 3600  # a stalled rank outlives the test; the launcher kills it


def _model(rank: int, world: int, kind: str) -> tuple[torch.nn.Module, torch.nn.Module, Muon]:
    model = sc.make_model()
    fwd = sc.wrap(model, kind, world)
    return model, fwd, Muon(model, **sc.OPT_KW)


def _timed_step(opt: Muon) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001 - what the test checks
        return {"raised": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0}
    return {"raised": None, "elapsed": time.monotonic() - t0}


def stall_before_step(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Both ranks train a step and run the next backward; then rank 1 stays alive but never
    calls step(). Rank 0's step must raise within DISTMUON_COMM_TIMEOUT_S."""
    _, fwd, opt = _model(rank, world, kind)
    sc.train(fwd, opt, range(1), rank, world)
    opt.zero_grad()
    sc.local_loss(fwd, 1, rank, world).backward()
    if rank == 1:
        time.sleep(STALL_S)
    return _timed_step(opt)


def kill_mid_step(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Rank 1 is killed inside its second step, at its second collective (the first, the vote,
    has completed on both ranks): rank 0 is then waiting in the middle of the exchange."""
    _, fwd, opt = _model(rank, world, kind)
    sc.train(fwd, opt, range(1), rank, world)
    opt.zero_grad()
    sc.local_loss(fwd, 1, rank, world).backward()
    if rank == 1:
        calls = [0]
        for name in ("all_reduce", "broadcast", "all_to_all_v", "all_gather_v", "reduce"):
            original = getattr(TorchCollectives, name)

            def wrapped(self: Any, *a: Any, _original: Any = original, **k: Any) -> Any:
                calls[0] += 1
                if calls[0] == 2:
                    kill_self()
                return _original(self, *a, **k)

            setattr(TorchCollectives, name, wrapped)
    return _timed_step(opt)


SAVED_AT, KILLED_AT, END = 3, 5, 7


def kill_mid_checkpoint(rank: int, world: int, root: str) -> dict[str, Any]:
    """A complete DCP checkpoint after SAVED_AT steps; rank 1 is killed while the one after
    KILLED_AT steps is being written. Rank 0 must raise (not hang)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    model, fwd, opt = _model(rank, world, "fsdp")
    sc.train(fwd, opt, range(SAVED_AT), rank, world)
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{root}/step{SAVED_AT}")
    sc.train(fwd, opt, range(SAVED_AT, KILLED_AT), rank, world)
    if rank == 1:
        original = FileSystemWriter.write_data

        def write_then_die(self: Any, *a: Any, **k: Any) -> Any:
            kill_self()
            return original(self, *a, **k)

        FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=f"{root}/step{KILLED_AT}")
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - what the test checks (DCP's is a BaseException)
        return {"raised": type(e).__name__, "message": str(e)[:2000], "elapsed": time.monotonic() - t0}
    return {"raised": None, "elapsed": time.monotonic() - t0}


def resume_after_the_fault(rank: int, world: int, root: str) -> dict[str, Any]:
    """New ranks: the interrupted checkpoint is refused; the last complete one loads and the
    training continues to END, against a run that was never interrupted."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    out: dict[str, Any] = {}
    model, fwd, opt = _model(rank, world, "fsdp")
    try:
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=f"{root}/step{KILLED_AT}")
        out["partial_loaded"] = True
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
        out["partial_loaded"] = False
        out["partial_error"] = f"{type(e).__name__}: {e}"[:500]
    model, fwd, opt = _model(rank, world, "fsdp")
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=f"{root}/step{SAVED_AT}")
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    out["losses"] = sc.train(fwd, opt, range(SAVED_AT, END), rank, world)
    out["params"] = sc.full_params(model)
    out["state"] = sc.full_state(opt)

    ref, ref_fwd, ref_opt = _model(rank, world, "fsdp")
    out["ref_losses"] = sc.train(ref_fwd, ref_opt, range(END), rank, world)[SAVED_AT:]
    out["ref_params"] = sc.full_params(ref)
    out["ref_state"] = sc.full_state(ref_opt)
    return out

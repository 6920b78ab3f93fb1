"""What the ranks of the distributed tests run (test_distributed.py launches them).

Every scenario trains the same small model on the same global batch: with W ranks each rank
takes 1/W of it, so that the mean gradient FSDP2/DDP produce equals the single-process one.
The model has a 3-row matrix (an empty FSDP2 shard at 4 ranks) and a 3D parameter of 2 matrices
(empty shards at 4 ranks, one owner per matrix).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distmuon.torch import Muon
from helpers import TinyGPT, full_params, full_state, load_checkpoint, make_batch, save_checkpoint, scenario_device
from helpers import train as train_loop
from helpers import write_cost_store

GLOBAL_BATCH = 8
STEPS = 10
CKPT_AT = 5
OPT_KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3}
# CacheMuon with decisions that do not depend on float rounding: every residual is below gamma,
# so each entry is reused twice after each refresh (refreshes at steps 0, 3, 6, 9).
CACHE_KW: dict[str, Any] = {**OPT_KW, "cache_gamma": 1e6, "cache_max_staleness": 2}


class DistGPT(TinyGPT):
    """TinyGPT plus a 3-row gate and a stack of two expert matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 3)
        self.experts = nn.Parameter(torch.randn(2, 16, 16) * 0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        h = h + self.proj(torch.tanh(self.qkv(self.ln(h))))
        h = h + self.out_proj(torch.nn.functional.gelu(self.fc(h)))
        h = h + 0.1 * torch.einsum("btd,edf->btf", h, self.experts) + self.gate(h).mean(-1, keepdim=True)
        return self.lm_head(h)


def make_model() -> DistGPT:
    torch.manual_seed(0)
    return DistGPT().to(scenario_device())


def local_loss(model: nn.Module, step: int, rank: int, world: int, amp: bool = False) -> torch.Tensor:
    """This rank's share of the global batch; `amp`: the forward under bf16 autocast."""
    x, y = make_batch(step, batch=GLOBAL_BATCH)
    per = GLOBAL_BATCH // world
    dev = scenario_device()
    x, y = x[rank * per : (rank + 1) * per].to(dev), y[rank * per : (rank + 1) * per].to(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(x)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def train(fwd: nn.Module, opt: Muon, steps: range, rank: int, world: int, amp: bool = False) -> list[float]:
    """Global mean loss of each step."""
    return train_loop(
        fwd, [opt], len(steps), lambda m, step: local_loss(m, step, rank, world, amp), first_step=steps.start
    )


def wrap(model: nn.Module, kind: str, world: int) -> nn.Module:
    """The module to call forward on: FSDP2 / HSDP shard `model` in place ("fsdp_mp": with bf16
    parameters in forward and fp32 gradient reduction), DDP wraps it."""
    dev = scenario_device()
    if kind in ("fsdp", "hsdp", "fsdp_mp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if kind == "hsdp":
            mesh = init_device_mesh(dev.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(dev.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if kind == "fsdp_mp" else None
        fully_shard(model, mesh=mesh, **({"mp_policy": mp} if mp else {}))
        return model
    if kind == "ddp":
        ids = [torch.cuda.current_device()] if dev.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return model


def guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A sub-scenario's result, or the error it raised (so one failure does not hide the rest)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


# ---- sub-scenarios ------------------------------------------------------------------------------


def run_train(
    rank: int,
    world: int,
    kind: str,
    ckpt: str | None = None,
    dist_mode: str = "auto",
    kw: dict[str, Any] | None = None,
    amp: bool = False,
) -> dict[str, Any]:
    """STEPS steps; with `ckpt`, a DCP checkpoint after CKPT_AT steps; `amp`: bf16 autocast."""
    model = make_model()
    fwd = wrap(model, kind, world)
    opt = Muon(model, dist_mode=dist_mode, **(kw or OPT_KW))
    losses = train(fwd, opt, range(CKPT_AT), rank, world, amp)
    saved = None if ckpt is None else save_checkpoint(model, opt, ckpt)
    losses += train(fwd, opt, range(CKPT_AT, STEPS), rank, world, amp)
    return {
        "mode": opt.dist_mode,
        "losses": losses,
        "params": full_params(model),
        "saved_state": saved,
        "final_state": full_state(opt),
        "owned": opt.engine_stats()["owned_matrices"],
        "stats": opt.stats(),
    }


def run_tune(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 with Muon.tune() before training (collective) and again after CKPT_AT steps (the
    engines are rebuilt, their state carried over): the same run as without it."""
    model = make_model()
    fwd = wrap(model, "fsdp", world)
    opt = Muon(model, **OPT_KW)
    rows = opt.tune()
    losses = train(fwd, opt, range(CKPT_AT), rank, world)
    again = opt.tune()
    losses += train(fwd, opt, range(CKPT_AT, STEPS), rank, world)
    return {"mode": opt.dist_mode, "losses": losses, "params": full_params(model), "rows": rows, "again": again}


def run_resume(rank: int, world: int, kind: str, ckpt: str, kw: dict[str, Any] | None = None) -> dict[str, Any]:
    """Loads the checkpoint into a fresh model and optimizer and trains the remaining steps."""
    model = make_model()
    fwd = wrap(model, kind, world)
    opt = Muon(model, **(kw or OPT_KW))
    loaded = load_checkpoint(model, opt, ckpt)
    losses = train(fwd, opt, range(CKPT_AT, STEPS), rank, world)
    return {"loaded_state": loaded, "losses": losses, "params": full_params(model), "stats": opt.stats()}


def run_grad_none(rank: int, world: int, kind: str, none_ranks: tuple[int, ...]) -> dict[str, Any]:
    """gate.weight without a gradient on every rank, then only on `none_ranks`, then a normal step."""
    model = make_model()
    fwd = wrap(model, kind, world)
    opt = Muon(model, **OPT_KW)
    train(fwd, opt, range(2), rank, world)

    def backward(drop: bool) -> None:
        opt.zero_grad()
        local_loss(fwd, 2, rank, world).backward()
        if drop:
            model.gate.weight.grad = None

    out: dict[str, Any] = {}
    before = full_params(model)
    backward(drop=True)
    opt.step()
    after_all = full_params(model)
    out["all_none_gate_unchanged"] = torch.equal(before["gate.weight"], after_all["gate.weight"])
    out["all_none_others_changed"] = not torch.equal(before["fc.weight"], after_all["fc.weight"])
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    steps = opt.state_dict()["state"]
    out["gate_step"] = float(steps[index[id(model.gate.weight)]]["step"])
    out["fc_step"] = float(steps[index[id(model.fc.weight)]]["step"])
    backward(drop=rank in none_ranks)
    try:
        opt.step()
        out["some_none_error"] = None
    except RuntimeError as e:
        out["some_none_error"] = str(e)
    after_some = full_params(model)
    out["some_none_unchanged"] = all(torch.equal(after_all[n], after_some[n]) for n in after_all)
    backward(drop=False)
    opt.step()
    out["recovered"] = not torch.equal(after_some["gate.weight"], full_params(model)["gate.weight"])
    return out


def run_state_reset(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Every rank deletes fc.weight's optimizer state after CKPT_AT steps (a re-initialised
    layer starts fresh, as in torch); the run must equal one process doing the same."""
    model = make_model()
    fwd = wrap(model, kind, world)
    opt = Muon(model, **OPT_KW)
    losses = train(fwd, opt, range(CKPT_AT), rank, world)
    del opt.state[model.fc.weight]
    losses += train(fwd, opt, range(CKPT_AT, STEPS), rank, world)
    index = [id(p) for g in opt.param_groups for p in g["params"]].index(id(model.fc.weight))
    return {
        "losses": losses,
        "params": full_params(model),
        "fc_step": float(opt.state_dict()["state"][index]["step"]),
    }


def run_lr_mismatch(rank: int, world: int, kind: str) -> dict[str, Any]:
    """A learning-rate scheduler stepped on rank 1 only: the next step fails on every rank and
    changes nothing; stepped on rank 0 too, training goes on."""
    model = make_model()
    fwd = wrap(model, kind, world)
    opt = Muon(model, **OPT_KW)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(fwd, opt, range(1), rank, world)
    if rank == 1:
        sched.step()
    opt.zero_grad()
    local_loss(fwd, 1, rank, world).backward()
    before = full_params(model)
    out: dict[str, Any] = {}
    try:
        opt.step()
        out["step_error"] = None
    except RuntimeError as e:
        out["step_error"] = str(e)
    out["unchanged"] = all(torch.equal(before[n], t) for n, t in full_params(model).items())
    if rank == 0:
        sched.step()
    opt.step()
    out["recovered"] = not torch.equal(before["fc.weight"], full_params(model)["fc.weight"])
    return out


def run_mismatch(rank: int, world: int, what: str) -> dict[str, Any]:
    """Rank 1 builds the optimizer over a different parameter set."""
    model = make_model()
    named = list(model.named_parameters())
    if rank == 1 and what == "missing":
        named = [(n, p) for n, p in named if n != "fc.weight"]
    if rank == 1 and what == "shape":
        named = [(n, nn.Parameter(torch.zeros(65, 16)) if n == "fc.weight" else p) for n, p in named]
    Muon(named, dist_mode="replicated", **OPT_KW)
    return {"built": True}


def run_fqn_api(rank: int, world: int) -> dict[str, Any]:
    """torch.distributed.checkpoint.state_dict's get/set_optimizer_state_dict round trip."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = make_model()
    fwd = wrap(model, "fsdp", world)
    opt = Muon(model, **OPT_KW)
    train(fwd, opt, range(3), rank, world)
    before = full_state(opt)
    osd = get_optimizer_state_dict(model, opt)
    keys = sorted(osd["state"])
    set_optimizer_state_dict(model, opt, osd)
    after = full_state(opt)
    same = all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])
    return {"keys": keys, "same": same}


def run_collectives(rank: int, world: int) -> dict[str, Any]:
    """The torch communicator's collectives as the engine calls them, including counts with
    gaps in the displacements (staged through contiguous buffers)."""
    from distmuon import _C
    from distmuon.torch._torch_comm import TorchCollectives

    comm = _C.make_python_communicator(
        TorchCollectives(dist.group.WORLD, torch.device("cpu")), rank, world, "test", list(range(world))
    )
    out: dict[str, Any] = {}
    t = torch.tensor([float(rank), -float(rank)])
    comm.all_reduce(t, 1)  # max
    out["max"] = t.tolist()
    b = torch.full((3,), float(rank))
    comm.broadcast(b, world - 1)
    out["broadcast"] = b.tolist()
    # member q sends counts[q][p] elements to member p, from displacements in reverse order
    counts = [[2, 3], [1, 4]]
    send = torch.arange(10, dtype=torch.float32) + 100 * rank
    send_counts = counts[rank]
    send_displs = [5, 0]
    recv_counts = [counts[0][rank], counts[1][rank]]
    recv_displs = [6, 1]  # gaps at 0 and between the pieces
    recv = torch.full((12,), -1.0)
    comm.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs)
    out["a2a"] = recv.tolist()
    comm.barrier()
    out["stats"] = comm.stats()
    return out


def run_grouped(rank: int, world: int) -> dict[str, Any]:
    """DDP training (replicated mode) on the torch communicator, counting how the engine's
    collectives reach Python: the broadcasts of a bucket's updates, which it issues as one
    group, come as one batch() call."""
    from distmuon.torch._torch_comm import TorchCollectives

    counts = {"batches": 0, "in_batch": 0, "alone": 0}
    inside = [0]
    batch, broadcast = TorchCollectives.batch, TorchCollectives.broadcast

    def counted_batch(self: Any, calls: Any) -> Any:
        counts["batches"] += 1
        inside[0] += 1
        try:
            return batch(self, calls)
        finally:
            inside[0] -= 1

    def counted_broadcast(self: Any, *args: Any) -> Any:
        counts["in_batch" if inside[0] else "alone"] += 1
        return broadcast(self, *args)

    TorchCollectives.batch, TorchCollectives.broadcast = counted_batch, counted_broadcast  # type: ignore[method-assign]
    try:
        res = run_train(rank, world, "ddp")
    finally:
        TorchCollectives.batch, TorchCollectives.broadcast = batch, broadcast  # type: ignore[method-assign]
    return {**counts, "params": res["params"]}


def run_plan_costs(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    """Every rank's measurement store holds other times for the 16 x 64 class (rank 0's: a batch
    costs a second whatever its size; the others': microseconds): the engine plans on rank 0's
    table, with scaled analytic costs for the other shapes, on every rank."""
    store = os.path.join(store_dir, f"rank{rank}.json")
    seconds = [(1, 1.0), (2, 1.0)] if rank == 0 else [(1, 1e-6 * rank), (2, 2e-6 * rank)]
    write_cost_store(store, {(16, 64): seconds})
    saved = os.environ["DISTMUON_COST_CACHE"]
    os.environ["DISTMUON_COST_CACHE"] = store
    try:
        model = make_model()
        wrap(model, "fsdp", world)
        opt = Muon(model, **OPT_KW)  # set-up plans the owners and checks the ranks agree
        return {"costs": opt._parts[0].engine.plan_costs}
    finally:
        os.environ["DISTMUON_COST_CACHE"] = saved


# ---- what each launch runs --------------------------------------------------------------------


def cache_ckpt(ckpt: str) -> str:
    """Where the CacheMuon run of the 2-rank launch writes its checkpoint."""
    return ckpt + "-cache"


def world2(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    return {
        "plan_costs": guarded(lambda: run_plan_costs(rank, world, str(Path(ckpt).parent))),
        "fsdp": guarded(lambda: run_train(rank, world, "fsdp", ckpt)),
        "resume2": guarded(lambda: run_resume(rank, world, "fsdp", ckpt)),
        "fsdp_cache": guarded(lambda: run_train(rank, world, "fsdp", cache_ckpt(ckpt), kw=CACHE_KW)),
        "gather_cache": guarded(lambda: run_train(rank, world, "fsdp", dist_mode="gather", kw=CACHE_KW)),
        "gather": guarded(lambda: run_train(rank, world, "fsdp", dist_mode="gather")),
        "ddp": guarded(lambda: run_train(rank, world, "ddp")),
        "tune": guarded(lambda: run_tune(rank, world)),
        "grad_none_fsdp": guarded(lambda: run_grad_none(rank, world, "fsdp", (1,))),
        "grad_none_ddp": guarded(lambda: run_grad_none(rank, world, "ddp", (0,))),
        "state_reset_fsdp": guarded(lambda: run_state_reset(rank, world, "fsdp")),
        "state_reset_ddp": guarded(lambda: run_state_reset(rank, world, "ddp")),
        "lr_mismatch_fsdp": guarded(lambda: run_lr_mismatch(rank, world, "fsdp")),
        "lr_mismatch_ddp": guarded(lambda: run_lr_mismatch(rank, world, "ddp")),
        "mismatch_missing": guarded(lambda: run_mismatch(rank, world, "missing")),
        "mismatch_shape": guarded(lambda: run_mismatch(rank, world, "shape")),
        "fqn_api": guarded(lambda: run_fqn_api(rank, world)),
        "collectives": guarded(lambda: run_collectives(rank, world)),
        "fsdp_wire": guarded(lambda: run_train(rank, world, "fsdp", kw={**OPT_KW, "wire_dtype": torch.bfloat16})),
        "ddp_wire": guarded(lambda: run_train(rank, world, "ddp", kw={**OPT_KW, "wire_dtype": torch.bfloat16})),
        "grouped": guarded(lambda: run_grouped(rank, world)),
    }


def world4(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    return {
        "fsdp": guarded(lambda: run_train(rank, world, "fsdp")),
        "hsdp": guarded(lambda: run_train(rank, world, "hsdp")),
        "resume4": guarded(lambda: run_resume(rank, world, "fsdp", ckpt)),
        "resume4_cache": guarded(lambda: run_resume(rank, world, "fsdp", cache_ckpt(ckpt), kw=CACHE_KW)),
        # rank 3 holds empty shards of gate.weight: no gradient there is no disagreement
        "grad_none_empty_shard": guarded(lambda: run_grad_none(rank, world, "fsdp", (3,))),
    }

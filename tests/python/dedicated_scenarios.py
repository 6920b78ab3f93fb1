"""What the ranks of the dedicated-mode tests run (test_dedicated.py launches them).

A small layered GPT: two blocks of four matrices (the units the runtime broadcasts per layer),
a 3-row gate after them (its own unit) and AdamW parameters that FSDP2 shards (LayerNorms,
embeddings, the head). Every rank takes 1/W of the same global batch (and 1/A of that
per micro-batch), so the mean gradient equals the single process's.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distmuon.torch import Muon, dedicate
from helpers import full, full_state, load_checkpoint, make_batch, save_checkpoint, scenario_device

GLOBAL_BATCH = 8
DIM = 64  # large enough that the planner balances arithmetic, not launches (so bytes too)
STEPS = 8
CKPT_AT = 4
OPT_KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3}


class Block(nn.Module):
    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(3 * dim, dim, bias=False)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.proj(torch.tanh(self.qkv(self.ln(h))))
        return h + self.out(nn.functional.gelu(self.fc(h)))


class LayeredGPT(nn.Module):
    def __init__(self, vocab: int = 23, dim: int = DIM, ctx: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.gate = nn.Linear(dim, 3)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            h = b(h)
        h = h + self.gate(h).mean(-1, keepdim=True)
        return self.lm_head(h)


def make_model() -> LayeredGPT:
    torch.manual_seed(0)
    return LayeredGPT().to(scenario_device())


def local_loss(
    model: nn.Module, step: int, rank: int, world: int, micro: int = 0, accum: int = 1, amp: bool = False
) -> torch.Tensor:
    """This rank's share of micro-batch `micro`; `amp`: the forward under bf16 autocast."""
    x, y = make_batch(step, batch=GLOBAL_BATCH)
    per = GLOBAL_BATCH // (world * accum)
    first = (rank * accum + micro) * per
    dev = scenario_device()
    x, y = x[first : first + per].to(dev), y[first : first + per].to(dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
        logits = model(x)
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)) / accum


def train(
    model: nn.Module,
    opt: Muon,
    steps: range,
    rank: int,
    world: int,
    accum: int = 1,
    dm: Any = None,
    sync_all: bool = False,
    amp: bool = False,
) -> list[float]:
    """Global mean loss of each step; micro-batches before the last skip gradient sync (unless
    sync_all: every backward reduces)."""
    out = []
    for step in steps:
        opt.zero_grad()
        total = torch.zeros((), device=scenario_device())
        for micro in range(accum):
            with ExitStack() as stack:
                if micro < accum - 1 and not sync_all:
                    if dm is not None:
                        stack.enter_context(dm.no_sync())
                    if hasattr(model, "set_requires_gradient_sync"):
                        model.set_requires_gradient_sync(False)
                elif hasattr(model, "set_requires_gradient_sync"):
                    model.set_requires_gradient_sync(True)
                loss = local_loss(model, step, rank, world, micro, accum, amp)
                loss.backward()
            total += loss.detach()
        opt.step()
        if dist.is_available() and dist.is_initialized() and world > 1:
            dist.all_reduce(total)
            total /= world
        out.append(total.item())
    return out


def full_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole (collective: the dedicated ones come through the state_dict hook)."""
    return {k: full(v) for k, v in model.state_dict().items()}


def mesh_of(kind: str, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    dev = scenario_device().type
    if kind == "hsdp":
        return init_device_mesh(dev, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(dev, (world,))


def build(kind: str, world: int, overlap: bool, kw: dict[str, Any] | None = None) -> tuple[nn.Module, Any, Muon]:
    """dedicate() the Muon matrices, fully_shard the rest (blocks, then the root), the optimizer."""
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    mesh = mesh_of(kind, world)
    dm = dedicate(model, mesh, overlap_step=overlap)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=dm.ignored_params)
    fully_shard(model, mesh=mesh, ignored_params=dm.ignored_params)
    return model, dm, Muon(model, **(kw or OPT_KW))


def guarded(fn: Any) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        import traceback

        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def run_dedicated(
    rank: int,
    world: int,
    kind: str,
    accum: int,
    overlap: bool,
    ckpt: str | None = None,
    sync_all: bool = False,
    amp: bool = False,
    kw: dict[str, Any] | None = None,
) -> dict[str, Any]:
    model, dm, opt = build(kind, world, overlap, kw)
    memory = dm.memory_stats()
    losses = train(model, opt, range(CKPT_AT), rank, world, accum, dm, sync_all, amp)
    saved = None if ckpt is None else save_checkpoint(model, opt, ckpt)
    losses += train(model, opt, range(CKPT_AT, STEPS), rank, world, accum, dm, sync_all, amp)
    after = dm.memory_stats()
    st = opt.stats()
    return {
        "mode": opt.dist_mode,
        "modes": opt.dist_modes,
        "losses": losses,
        "params": full_model(model),
        "saved_state": saved,
        "final_state": full_state(opt),
        "memory_at_start": memory,
        "memory": after,
        "owned": st["owned_matrices"],
        "owners": dm.owners,
        "plan": {k: dm.plan[k] for k in ("solver", "imbalance")},
        "dedicated_grads_dropped": all(
            m.param.grad is None or m.owner == dm.grid.member for m in dm.matrices
        ),
    }


def run_resume(rank: int, world: int, kind: str, ckpt: str, kw: dict[str, Any] | None = None) -> dict[str, Any]:
    model, dm, opt = build(kind, world, overlap=True, kw=kw)
    loaded = load_checkpoint(model, opt, ckpt)
    memory = dm.memory_stats()
    losses = train(model, opt, range(CKPT_AT, STEPS), rank, world, 1, dm)
    return {"loaded_state": loaded, "losses": losses, "params": full_model(model), "memory_after_load": memory}


def run_late_gradient(rank: int, world: int) -> dict[str, Any]:
    """overlap_step with two synchronised backwards: every rank raises at step(); the ranks stay
    matched (a checkpointable state and another step afterwards)."""
    model, dm, opt = build("fsdp", world, overlap=True)
    out: dict[str, Any] = {}
    try:
        train(model, opt, range(1), rank, world, 2, dm, sync_all=True)
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    opt.zero_grad()
    out["then"] = train(model, opt, range(1, 2), rank, world, 1, dm)  # collectives still matched
    return out


def run_traffic(rank: int, world: int) -> dict[str, Any]:
    """What one synchronised backward moves on the dedicated traffic's communicators, after a
    first step (flat: every bucket's reduction is issued during backward), with the buckets."""
    model, dm, opt = build("fsdp", world, overlap=False)
    out: dict[str, Any] = {"steps": []}
    for step in range(2):  # owners' gradients: fresh tensors, then (set_to_none=False) views
        opt.zero_grad(set_to_none=step == 0)
        loss = local_loss(model, step, rank, world)
        before = dm.transfers.traffic()
        loss.backward()
        after = dm.transfers.traffic()
        opt.step()
        out["steps"].append({k: after[k] - before[k] for k in before})
    out["buckets"] = [{"owner": b.owner, "nbytes": b.nbytes} for b in dm.buckets]
    out["matrices"] = len(dm.matrices)
    out["member"] = dm.grid.member
    out["params"] = full_model(model)
    return out


def run_collected(rank: int, world: int, kind: str) -> dict[str, Any]:
    """After two steps and `del`, Python's collector frees the model, what dedicate() returned
    and the optimizer ("plain": the optimizer over an FSDP2 model, no dedicate()): nothing holds
    them, or their communicators, until the process ends."""
    import gc
    import weakref

    def arm() -> list[weakref.ref[Any]]:
        if kind == "plain":
            from torch.distributed.fsdp import fully_shard

            model = make_model()
            fully_shard(model, mesh=mesh_of("fsdp", world))
            dm, opt = None, Muon(model, **OPT_KW)
        else:
            model, dm, opt = build(kind, world, overlap=True)
        train(model, opt, range(2), rank, world, 1, dm, False, False)
        return [weakref.ref(x) for x in (model, opt) + ((dm,) if dm is not None else ())]

    refs = arm()
    gc.collect()
    return {"alive": [r() is not None for r in refs]}


def run_corrupt_store(rank: int, world: int, store_dir: str) -> dict[str, Any]:
    """Rank 0's measurement store is corrupt (the other ranks have none): dedicate() raises on
    every rank instead of leaving them waiting for rank 0's plan."""
    store = os.path.join(store_dir, f"corrupt-rank{rank}.json")
    if rank == 0:
        with open(store, "w") as f:
            f.write("{not json")
    saved = os.environ["DISTMUON_COST_CACHE"]
    os.environ["DISTMUON_COST_CACHE"] = store
    try:
        build("fsdp", world, overlap=False)
        return {"built": True}
    finally:
        os.environ["DISTMUON_COST_CACHE"] = saved


def run_single(rank: int, world: int, overlap: bool) -> dict[str, Any]:
    """World size 1: every matrix owned here, nothing moves; overlap_step prepares during
    backward (through the engine's dedicated mode all the same)."""
    model = make_model()
    dm = dedicate(model, mesh_of("fsdp", 1), overlap_step=overlap)
    opt = Muon(model, **OPT_KW)
    losses = train(model, opt, range(STEPS), 0, 1, 1, dm)
    return {"mode": opt.dist_mode, "losses": losses, "params": full_model(model), "memory": dm.memory_stats()}


def run_single_unheld(rank: int, world: int) -> dict[str, Any]:
    """World size 1, the handle dedicate() returns not kept (no hook refers to it at one rank):
    the model keeps it, so the optimizer still finds the dedicated matrices."""
    import gc

    model = make_model()
    dedicate(model, mesh_of("fsdp", 1))
    gc.collect()
    opt = Muon(model, **OPT_KW)
    losses = train(model, opt, range(STEPS), 0, 1)
    held = model._distmuon_dedicated  # the model's reference
    return {"mode": opt.dist_mode, "losses": losses, "params": full_model(model), "memory": held.memory_stats()}


# ---- what each launch runs --------------------------------------------------------------------


def run_reference(rank: int, world: int) -> dict[str, Any]:
    """The plain optimizer in the same kind of process (same torch threads)."""
    model = make_model()
    opt = Muon(model, **OPT_KW)
    losses = train(model, opt, range(STEPS), 0, 1)
    return {"mode": opt.dist_mode, "losses": losses, "params": full_model(model)}


def world1(rank: int, world: int) -> dict[str, Any]:
    return {
        "reference": guarded(lambda: run_reference(rank, world)),
        "single": guarded(lambda: run_single(rank, world, overlap=False)),
        "single_overlap": guarded(lambda: run_single(rank, world, overlap=True)),
        "single_unheld": guarded(lambda: run_single_unheld(rank, world)),
    }


def world2(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    return {
        "plain": guarded(lambda: run_dedicated(rank, world, "fsdp", 1, False, ckpt)),
        "overlap": guarded(lambda: run_dedicated(rank, world, "fsdp", 1, True)),
        "accum": guarded(lambda: run_dedicated(rank, world, "fsdp", 2, False)),
        "accum_overlap": guarded(lambda: run_dedicated(rank, world, "fsdp", 2, True)),
        "accum_sync": guarded(lambda: run_dedicated(rank, world, "fsdp", 2, False, sync_all=True)),
        "late_gradient": guarded(lambda: run_late_gradient(rank, world)),
        "traffic": guarded(lambda: run_traffic(rank, world)),
        "collected": guarded(lambda: run_collected(rank, world, "fsdp")),
        "collected_plain": guarded(lambda: run_collected(rank, world, "plain")),
        "corrupt_store": guarded(lambda: run_corrupt_store(rank, world, str(Path(ckpt).parent))),
    }


def world4(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    return {
        "flat": guarded(lambda: run_dedicated(rank, world, "fsdp", 1, True)),
        "flat_accum": guarded(lambda: run_dedicated(rank, world, "fsdp", 2, False)),
        "hsdp": guarded(lambda: run_dedicated(rank, world, "hsdp", 1, True)),
        "hsdp_accum": guarded(lambda: run_dedicated(rank, world, "hsdp", 2, True)),
        "resume4": guarded(lambda: run_resume(rank, world, "fsdp", ckpt)),
        "traffic": guarded(lambda: run_traffic(rank, world)),
        "collected_hsdp": guarded(lambda: run_collected(rank, world, "hsdp")),
    }

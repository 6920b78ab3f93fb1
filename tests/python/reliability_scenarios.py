"""What the ranks of test_reliability.py run: the optimizer built before FSDP2 shards the model,
then handed the sharded parameters the way accelerate does it, against the optimizer built after
sharding (the documented way)."""

from __future__ import annotations

from typing import Any

import torch

import dist_scenarios as sc
from distmuon.torch import Muon


def accelerate_swap(model: torch.nn.Module, opt: torch.optim.Optimizer, shard: Any) -> None:
    """What accelerate's FSDP2 preparation does to an optimizer made before the model was
    sharded: shard the model, then put the new (DTensor) parameters into the optimizer's groups
    in place of the old ones, matched by name."""
    old = {id(p): n for n, p in model.named_parameters()}
    shard(model)
    new = dict(model.named_parameters())
    for group in opt.param_groups:
        group["params"] = [new[old[id(p)]] for p in group["params"]]


def run_swap(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    steps = range(3)

    model = sc.make_model()
    opt = Muon(model, **sc.OPT_KW)  # plain parameters in a world of 2: the replicated mode
    built_as = opt.dist_mode
    accelerate_swap(model, opt, lambda m: fully_shard(m, mesh=mesh))
    losses = sc.train(model, opt, steps, rank, world)

    ref = sc.make_model()
    fully_shard(ref, mesh=mesh)
    ref_opt = Muon(ref, **sc.OPT_KW)
    ref_losses = sc.train(ref, ref_opt, steps, rank, world)
    return {
        "built_as": built_as,
        "mode": opt.dist_mode,
        "losses": losses,
        "ref_losses": ref_losses,
        "params": sc.full_params(model),
        "ref_params": sc.full_params(ref),
        "initial": sc.full_params(sc.make_model()),
        "state": sc.full_state(opt),
        "ref_state": sc.full_state(ref_opt),
    }

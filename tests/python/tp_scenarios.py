"""What the ranks of the tensor / expert parallel tests run (test_tp.py launches them).

A tiny Llama-style model: attention (fused QKV and an output projection, left whole over the
``tp`` dim), a SwiGLU MLP (w1, w3 ColwiseParallel, w2 RowwiseParallel on ``tp``) and a stack of
4 experts split over an ``ep`` dim. Sizes are odd on purpose: w1 / w3 have 30 rows, cut 15 per
``tp`` rank and 8 / 7 per ``dp`` rank (uneven FSDP2 shards of a tensor-parallel dim).

Tensor and expert parallel ranks see the same tokens (the data is split over the data-parallel
dims only), so that every layout trains on the single process's global batch; the expert
outputs are summed over ``ep`` with an all-reduce whose backward is the identity (Megatron's
"g" operator, as RowwiseParallel's output).

The scenarios run where helpers.scenario_device() says: gloo ranks on the CPU (test_tp.py), NCCL
ranks on CUDA (test_gpu_tp.py). The model is built on the CPU (the same weights everywhere) and
moved there; what they return is on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distmuon.torch import Muon
from helpers import full_params, full_state, load_checkpoint, make_batch, save_checkpoint, scenario_device
from helpers import train as train_loop

GLOBAL_BATCH = 4
STEPS = 5
CKPT_AT = 3
OPT_KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3}
# One block per head of the fused q, k, v (4 heads of 4 rows each) and the two halves of w1: the
# blocks are cut through by FSDP2's shards (w1's 8 / 7 rows of 15 per tp rank).
BLOCKS_KW: dict[str, Any] = {**OPT_KW, "row_blocks": {"wqkv.weight": 12, "w1.weight": 2}}
DIM, HIDDEN, EXPERTS, VOCAB = 16, 30, 4, 23
# The traffic scenario's block: wide enough that the matrices, not the control messages, make the
# traffic (4.26 MB of Muon matrices in float32), sizes that 4 ranks cut evenly.
TRAFFIC_DIM, TRAFFIC_HIDDEN, TRAFFIC_STEPS = 256, 704, 2


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: the output of a region split over a
    group (Megatron's "g", as RowwiseParallel's output)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """Identity in forward, all-reduce (sum) in backward: the input of a region split over a
    group, whose parts each see a part of the gradient (Megatron's "f")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class TPModel(nn.Module):
    """`dim` and `hidden` other than DIM / HIDDEN: the wider block of the traffic scenario."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.attn_norm = nn.LayerNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.LayerNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.router = nn.Linear(dim, EXPERTS, bias=False)
        self.experts = nn.Parameter(torch.randn(EXPERTS, dim, dim) * 0.1)
        self.output = nn.Linear(dim, VOCAB, bias=False)
        self.ep_group: Any = None  # set when the experts are split over an ep dim
        self.dp_group: Any = None  # set when the experts are left out of fully_shard

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx)
        q, k, v = self.wqkv(self.attn_norm(h)).chunk(3, dim=-1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.wo(a)
        x = self.mlp_norm(h)
        h = h + self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))
        gates, inp = torch.softmax(self.router(h), dim=-1), h
        experts = self.experts
        if self.ep_group is None and hasattr(experts, "full_tensor"):  # split over tp along its matrices
            experts = experts.full_tensor()  # type: ignore[operator]
        elif hasattr(experts, "to_local"):  # split over ep: this rank's experts, summed over ep
            experts = experts.to_local()  # type: ignore[operator]
            gates, inp = _CopyToGroup.apply(gates, self.ep_group), _CopyToGroup.apply(h, self.ep_group)
            first = dist.get_group_rank(self.ep_group, dist.get_rank()) * experts.shape[0]
            gates = gates[..., first : first + experts.shape[0]]
        mixed = torch.einsum("bte,edf,btd->btf", gates, experts, inp)
        if self.ep_group is not None:
            mixed = _SumOverGroup.apply(mixed, self.ep_group)
        return self.output(h + mixed)


def make_model(dim: int = DIM, hidden: int = HIDDEN) -> TPModel:
    torch.manual_seed(0)
    return TPModel(dim, hidden).to(scenario_device())


def local_loss(model: nn.Module, step: int, dp_rank: int, dp: int) -> torch.Tensor:
    x, y = make_batch(step, vocab=VOCAB, batch=GLOBAL_BATCH)
    per = GLOBAL_BATCH // dp
    dev = scenario_device()
    x, y = x[dp_rank * per : (dp_rank + 1) * per].to(dev), y[dp_rank * per : (dp_rank + 1) * per].to(dev)
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def train(model: nn.Module, opt: Muon, steps: range, dp_rank: int = 0, dp: int = 1) -> list[float]:
    """The global batch's mean loss of each step (every rank's loss averaged over the world:
    tensor / expert parallel peers hold the same)."""
    return train_loop(
        model,
        [opt],
        len(steps),
        lambda m, step: local_loss(m, step, dp_rank, dp),
        first_step=steps.start,
        after_backward=lambda: average_ignored(model),  # type: ignore[arg-type]
    )


# ---- layouts ---------------------------------------------------------------------------------


def parallelize(model: TPModel, layout: str) -> tuple[int, int]:
    """Lays `model` out on this world; returns (data-parallel rank, data-parallel size).

    - 'tp': (dp 2, tp 2): MLP tensor-parallel, fully_shard on dp (attention and the rest on the
      dp sub-mesh, whole over tp).
    - 'hsdp_tp': (replicate 2, shard 2, tp 2): the same with HSDP.
    - 'ep': (dp 2, ep 2): experts split over ep, fully_shard on dp (experts too).
    - 'ep_nofsdp': the same with the experts left out of fully_shard (replicated over dp; their
      gradients averaged over dp by hand).
    - 'fsdp': fully_shard over every rank.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    dev = scenario_device().type
    if layout == "fsdp":
        fully_shard(model, mesh=init_device_mesh(dev, (world,)))
        return dist.get_rank(), world
    if layout in ("tp", "hsdp_tp"):
        shape, names = ((2, 2), ("dp", "tp")) if layout == "tp" else ((2, 2, 2), ("rep", "shard", "tp"))
        mesh = init_device_mesh(dev, shape, mesh_dim_names=names)
        plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
        parallelize_module(model, mesh["tp"], plan)
        # a stack of matrices split along their columns (the engine assembles each whole)
        model.experts = nn.Parameter(distribute_tensor(model.experts.data, mesh["tp"], [Shard(2)]))
        dp_mesh = mesh["dp"] if layout == "tp" else mesh["rep", "shard"]
        fully_shard(model, mesh=dp_mesh)
        coord = mesh.get_coordinate()
        dp_rank = coord[0] if layout == "tp" else coord[0] * 2 + coord[1]
        return dp_rank, dp_mesh.size()
    mesh = init_device_mesh(dev, (2, 2), mesh_dim_names=("dp", "ep"))
    model.experts = nn.Parameter(distribute_tensor(model.experts.data, mesh["ep"], [Shard(0)]))
    model.ep_group = mesh["ep"].get_group()
    if layout == "ep":
        fully_shard(model, mesh=mesh["dp"])
    else:
        fully_shard(model, mesh=mesh["dp"], ignored_params={model.experts})
        model.dp_group = mesh["dp"].get_group()
    return mesh.get_coordinate()[0], 2


def average_ignored(model: TPModel) -> None:
    """'ep_nofsdp': the experts' gradients averaged over dp (what DDP would do)."""
    if model.dp_group is not None and model.experts.grad is not None:
        g = model.experts.grad.to_local()  # type: ignore[operator]
        dist.all_reduce(g, group=model.dp_group)
        g /= dist.get_world_size(model.dp_group)


def run_layout(
    rank: int, world: int, layout: str, ckpt: str | None = None, kw: dict[str, Any] | None = None
) -> dict[str, Any]:
    """STEPS steps of `layout`; with `ckpt`, a DCP checkpoint after CKPT_AT steps."""
    model = make_model()
    dp_rank, dp = parallelize(model, layout)
    opt = Muon(model, **(kw or OPT_KW))
    losses = train(model, opt, range(CKPT_AT), dp_rank, dp)
    saved = None if ckpt is None else save_checkpoint(model, opt, ckpt)
    losses += train(model, opt, range(CKPT_AT, STEPS), dp_rank, dp)
    topo = opt._parts[0].topo
    return {
        "mode": opt.dist_mode,
        "replicate": topo.replicate,
        "losses": losses,
        "params": full_params(model),
        "state": full_state(opt),
        "saved_state": saved,
        "owned": opt.engine_stats()["owned_matrices"],
        "kinds": {s.name: (s.placed.kind if s.placed is not None else "fsdp") for s in opt._slots},
    }


def run_resume(
    rank: int, world: int, layout: str, ckpt: str, kw: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A fresh model and optimizer in `layout` (any world size) load the checkpoint written after
    CKPT_AT steps and train the remaining steps."""
    model = make_model()
    dp_rank, dp = parallelize(model, layout) if dist.is_initialized() else (0, 1)
    opt = Muon(model, **(kw or OPT_KW))
    loaded = load_checkpoint(model, opt, ckpt)
    losses = train(model, opt, range(CKPT_AT, STEPS), dp_rank, dp)
    return {"loaded_state": loaded, "losses": losses, "params": full_params(model)}


def _error(fn: Any) -> str | None:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def run_refusals(rank: int, world: int) -> dict[str, Any]:
    """Placements the optimizer cannot take, each refused on every rank at construction (or by
    add_param_group, which then leaves the optimizer as it was)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    dev = scenario_device()
    mesh = init_device_mesh(dev.type, (2, 2), mesh_dim_names=("dp", "tp"))
    partial = nn.Parameter(DTensor.from_local(torch.randn(4, 8, device=dev), mesh, [Shard(0), Partial()]))
    rows = 3 if mesh.get_coordinate()[0] == 0 else 5  # not torch.chunk's cut of 8 rows
    local = torch.randn(rows, 4, device=dev)
    uneven = nn.Parameter(
        DTensor.from_local(local, mesh, [Shard(0), Shard(1)], run_check=False, shape=(8, 8), stride=(8, 1))
    )
    out: dict[str, Any] = {
        "partial": _error(lambda: Muon([("blocks.0.w", partial)], **OPT_KW)),
        "uneven": _error(lambda: Muon([("blocks.1.w", uneven)], **OPT_KW)),
    }
    model = make_model()
    dp_rank, dp = parallelize(model, "tp")
    out["gather"] = _error(lambda: Muon(model, dist_mode="gather", **OPT_KW))
    other = init_device_mesh(dev.type, (4,))
    foreign = nn.Parameter(DTensor.from_local(torch.randn(2, 8, device=dev), other, [Shard(0)]))
    out["roots"] = _error(lambda: Muon([*model.named_parameters(), ("foreign", foreign)], **OPT_KW))
    opt = Muon(model, **OPT_KW)
    groups = len(opt.param_groups)
    out["add_group"] = _error(lambda: opt.add_param_group({"params": [("blocks.0.w", partial)], "use_muon": True}))
    out["groups_kept"] = len(opt.param_groups) == groups
    train(model, opt, range(2), dp_rank, dp)  # the optimizer still steps
    out["steps"] = opt.stats()["steps"]
    return out


def run_grad_none(rank: int, world: int) -> dict[str, Any]:
    """dp 2 x tp 2: w2.weight (RowwiseParallel, remapped) without a gradient on every rank is
    skipped; without one on rank 1 only, the step fails on every rank and changes nothing; the
    next full step goes on."""
    model = make_model()
    dp_rank, dp = parallelize(model, "tp")
    opt = Muon(model, **OPT_KW)
    train(model, opt, range(1), dp_rank, dp)

    def backward(drop: bool) -> None:
        opt.zero_grad()
        local_loss(model, 1, dp_rank, dp).backward()
        if drop:
            model.w2.weight.grad = None

    out: dict[str, Any] = {}
    before = full_params(model)
    backward(drop=True)
    opt.step()
    after = full_params(model)
    out["all_none_kept"] = torch.equal(before["w2.weight"], after["w2.weight"])
    out["all_none_others_moved"] = not torch.equal(before["w1.weight"], after["w1.weight"])
    backward(drop=rank == 1)
    try:
        opt.step()
        out["some_none_error"] = None
    except RuntimeError as e:
        out["some_none_error"] = str(e)
    out["some_none_unchanged"] = all(torch.equal(after[n], t) for n, t in full_params(model).items())
    backward(drop=False)
    opt.step()
    out["recovered"] = not torch.equal(after["w2.weight"], full_params(model)["w2.weight"])
    return out


def run_fqn_api(rank: int, world: int) -> dict[str, Any]:
    """torch.distributed.checkpoint.state_dict's get/set_optimizer_state_dict round trip at dp 2
    x tp 2, with row blocks (remapped momentum both ways)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = make_model()
    dp_rank, dp = parallelize(model, "tp")
    opt = Muon(model, **BLOCKS_KW)
    train(model, opt, range(2), dp_rank, dp)
    before = full_state(opt)
    osd = get_optimizer_state_dict(model, opt)
    set_optimizer_state_dict(model, opt, osd)
    after = full_state(opt)
    same = all(torch.equal(before[i][k], after[i][k]) for i in before for k in before[i])
    return {"keys": sorted(osd["state"]), "same": same}


def tp_shard_dim(p: Any) -> int | None:
    """The dim a parameter is split along over ``tp``; None where it is whole over tp (its mesh
    has no such dim, or it is replicated there)."""
    from torch.distributed.tensor import Shard

    names = p.device_mesh.mesh_dim_names or ()
    placement = p.placements[names.index("tp")] if "tp" in names else None
    return placement.dim if isinstance(placement, Shard) else None


def run_traffic(rank: int, world: int) -> dict[str, Any]:
    """TRAFFIC_STEPS steps of the wider block (TRAFFIC_DIM, TRAFFIC_HIDDEN) at dp 2 x tp 2: the
    bytes this rank moved in each, each way (the engine's communicator: ``comm_bytes_*``; the
    front's transfers of remapped parameters: ``remap_bytes_*``), and what a closed-form count
    needs: every parameter's shape, kind, split over tp and (Muon) owner of each matrix."""
    model = make_model(TRAFFIC_DIM, TRAFFIC_HIDDEN)
    dp_rank, dp = parallelize(model, "tp")
    opt = Muon(model, **OPT_KW)
    keys = ("comm_bytes_sent", "comm_bytes_received", "comm_ops", "remap_bytes_sent", "remap_bytes_received")
    steps = []
    for step in range(TRAFFIC_STEPS):
        before = opt.engine_stats()
        train(model, opt, range(step, step + 1), dp_rank, dp)
        after = opt.engine_stats()
        steps.append({k: after[k] - before[k] for k in keys})
    part = opt._parts[0]
    params = []
    for s in part.slots:
        slices = s.engine_shape[0] if len(s.engine_shape) == 3 else 1
        params.append({
            "name": s.name,
            "shape": tuple(s.full_shape),
            "muon": s.use_muon,
            "kind": s.placed.kind if s.placed is not None else "fsdp",
            "tp_dim": tp_shard_dim(s.param),
            "owners": [part.engine.owner(s.index, k) for k in range(slices)] if s.use_muon else [],
            "element_size": s.param.element_size(),
        })
    return {"steps": steps, "params": params, "mode": opt.dist_mode}


def ep_ckpt(ckpt: str) -> str:
    """Where the ep 2 x dp 2 run writes its checkpoint."""
    return ckpt + "-ep"


def world4(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    from dist_scenarios import guarded

    return {
        "tp": guarded(lambda: run_layout(rank, world, "tp", ckpt)),
        "ep": guarded(lambda: run_layout(rank, world, "ep", ep_ckpt(ckpt))),
        "ep_nofsdp": guarded(lambda: run_layout(rank, world, "ep_nofsdp")),
        "tp_blocks": guarded(lambda: run_layout(rank, world, "tp", kw=BLOCKS_KW)),
        "refusals": guarded(lambda: run_refusals(rank, world)),
        "grad_none": guarded(lambda: run_grad_none(rank, world)),
        "fqn_api": guarded(lambda: run_fqn_api(rank, world)),
        "traffic": guarded(lambda: run_traffic(rank, world)),
    }


# The NCCL arms (test_gpu_tp.py) iterate in float32, so that they compare tightly with one process.
NCCL_KW: dict[str, Any] = {**OPT_KW, "ns_dtype": torch.float32}


def nccl_world4(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """What test_gpu_tp.py's NCCL ranks run, each scenario named on stderr as it starts (a hang
    names it)."""
    import sys
    import time

    from dist_scenarios import guarded

    arms = {
        "tp": lambda: run_layout(rank, world, "tp", ckpt, kw=NCCL_KW),
        "ep": lambda: run_layout(rank, world, "ep", ep_ckpt(ckpt), kw=NCCL_KW),
        "ep_nofsdp": lambda: run_layout(rank, world, "ep_nofsdp", kw=NCCL_KW),
    }
    out = {}
    for name, fn in arms.items():
        print(f"[rank {rank} {time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)
        out[name] = guarded(fn)
    return out


def world2(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    from dist_scenarios import guarded

    return {
        "resume_fsdp": guarded(lambda: run_resume(rank, world, "fsdp", ckpt)),
        "fsdp_blocks": guarded(lambda: run_layout(rank, world, "fsdp", kw=BLOCKS_KW)),
    }


def world8(rank: int, world: int) -> dict[str, Any]:
    from dist_scenarios import guarded

    return {"hsdp_tp": guarded(lambda: run_layout(rank, world, "hsdp_tp"))}

"""Tensor, expert and data parallel layouts: which elements of each parameter every rank holds,
and the dim-0 rows the engine sees of it.

torch's DTensor placements give every rank a box of each parameter: ``parallelize_module``'s
ColwiseParallel ``Shard(0)`` and RowwiseParallel ``Shard(1)`` on a ``tp`` mesh dimension, expert
stacks ``Shard(0)`` on an ``ep`` dimension, ``fully_shard``'s ``Shard(0)`` (``_StridedShard`` over
an already sharded dim) on ``dp_shard``, ``Replicate`` on ``dp_replicate`` and wherever a
parameter's sub-mesh lacks a dimension (attention left whole over ``tp``). Each rank works out its
own box from its placements; one exchange at construction tells every rank every rank's boxes.

The engine's sharded mode takes each parameter as dim-0 rows per member, the rows of each
replica's members tiling dim 0 (the shape FSDP2 gives on one mesh). A parameter that already has
that shape on the world is registered as it lies ("native": ColwiseParallel x FSDP2, expert
stacks split over experts). Any other Muon parameter is seen by the engine through rows of its
own (torch.chunk's cut of dim 0 over the shard positions) that the front fills from the
parameters' boxes before the step and copies back after it (``_remap``): each matrix is still
assembled and orthogonalized once, by its owner. AdamW is elementwise, so an AdamW parameter is
registered as the flat box each rank holds (no data moves).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distmuon.torch._dist import Topology, chunk_rows, hsdp_coords, local_tensor

Runs = tuple[tuple[int, int], ...]  # sorted, disjoint [start, stop) ranges of one dim's indices
Holding = tuple[Runs, ...]  # what one rank holds of a tensor: the product of one Runs per dim


def _length(runs: Runs) -> int:
    return sum(b - a for a, b in runs)


def _slice(runs: Runs, lo: int, hi: int) -> Runs:
    """Positions [lo, hi) of the index list that `runs` spell."""
    out, pos = [], 0
    for a, b in runs:
        s, e = max(lo, pos), min(hi, pos + b - a)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += b - a
    return tuple(out)


def _chunk(runs: Runs, parts: int, index: int) -> Runs:
    begin, count = chunk_rows(_length(runs), parts, index)
    return _slice(runs, begin, begin + count)


def _merged(runs: list[tuple[int, int]]) -> Runs:
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def describe(p: Any) -> str:
    names = p.device_mesh.mesh_dim_names
    dims = f" over mesh dims {tuple(names)}" if names else f" on a {p.device_mesh.ndim}D mesh"
    return f"placements {tuple(p.placements)}{dims}"


def own_holding(name: str, p: Any) -> Holding:
    """This rank's box of DTensor `p`, as torch cuts it: Shard is torch.chunk's cut of what the
    earlier mesh dims left, _StridedShard(sf) cuts each of sf pieces and joins the parts (FSDP2
    over a tensor-parallel dim). Partial and other placements raise, naming the parameter."""
    from torch.distributed.tensor import Replicate, Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # a torch without it cannot make the placement either
        _StridedShard = None  # type: ignore[assignment,misc]
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    dims: list[Runs] = [((0, int(n)),) if n else () for n in p.shape]
    for i, pl in enumerate(p.placements):
        n, c = mesh.size(i), coord[i]
        if type(pl) is Replicate:
            continue
        if type(pl) not in (Shard, _StridedShard) or not -p.ndim <= pl.dim < p.ndim:
            raise ValueError(
                f"parameter '{name}' has {describe(p)}: distmuon handles Shard, Replicate and FSDP2's "
                f"_StridedShard; {pl} on mesh dim {i} is not one (a Partial value is not the "
                "parameter; redistribute it to Replicate or Shard first)"
            )
        d = pl.dim % p.ndim
        if type(pl) is Shard:
            dims[d] = _chunk(dims[d], n, c)
        else:
            sf = int(pl.split_factor)
            dims[d] = _merged([r for j in range(sf) for r in _chunk(_chunk(dims[d], sf, j), n, c)])
    holding = tuple(dims)
    local = local_tensor(p)
    if tuple(local.shape) != tuple(_length(r) for r in holding):
        raise ValueError(
            f"parameter '{name}' with {describe(p)}: the local shard has shape {tuple(local.shape)} "
            f"where torch.chunk's cut of {tuple(p.shape)} gives {tuple(_length(r) for r in holding)} "
            "here; distmuon needs the shards DTensor makes"
        )
    return holding


def numel(h: Holding) -> int:
    return math.prod(_length(r) for r in h)


def boxes(h: Holding) -> list[tuple[tuple[tuple[int, int], ...], tuple[int, ...]]]:
    """The boxes (one run per dim) of a holding, each with its offset in the holder's local tensor."""
    out: list[tuple[tuple[tuple[int, int], ...], tuple[int, ...]]] = [((), ())]
    for runs in h:
        offsets, pos = [], 0
        for a, b in runs:
            offsets.append(pos)
            pos += b - a
        out = [(box + (r,), off + (o,)) for box, off in out for r, o in zip(runs, offsets)]
    return out


def native_rows(holdings: tuple[Holding, ...], shape: torch.Size, shard: int) -> tuple[tuple[int, int], ...] | None:
    """(begin, count) of dim 0 per member when every member holds whole dim-0 rows and each
    replica's members tile dim 0 (the engine's sharded layout as it lies); else None."""
    rows = []
    for h in holdings:
        if any(r != (((0, int(n)),) if n else ()) for r, n in zip(h[1:], shape[1:])) or len(h[0]) > 1:
            return None
        rows.append((h[0][0][0], h[0][0][1] - h[0][0][0]) if h[0] else (0, 0))
    for start in range(0, len(rows), shard):
        covered = sorted((b, n) for b, n in rows[start : start + shard] if n > 0)
        nxt = 0
        for b, n in covered:
            if b != nxt:
                return None
            nxt = b + n
        if nxt != shape[0]:
            return None
    return tuple(rows)


def chunked_rows(dim0: int, topo: Topology) -> tuple[tuple[int, int], ...]:
    """The rows the engine sees of a remapped parameter: torch.chunk's cut over shard positions."""
    return tuple(chunk_rows(dim0, topo.shard_size, topo.shard_position(m)) for m in range(topo.size))


def flat_rows(holdings: tuple[Holding, ...], shard: int) -> tuple[tuple[int, int], ...]:
    """An AdamW parameter as the engine sees it in the layout path: each member's box, flattened,
    at its offset among its replica's boxes (dim 0 of a 1-D tensor of their total size)."""
    out, offset = [], 0
    for m, h in enumerate(holdings):
        if m % shard == 0:
            offset = 0
        out.append((offset, numel(h)))
        offset += numel(h)
    return tuple(out)


@dataclass(frozen=True)
class _World:
    ranks: tuple[int, ...]  # global ranks of the members, in the root mesh's row-major order
    root: Any
    dims: tuple[int, ...]  # the root mesh dims the members span, in order


def _world(meshes: list[Any]) -> _World:
    """The members: the ranks of the root mesh that differ from this rank only along root dims
    that some parameter's mesh spans (not a pipeline stage's other ranks)."""
    roots = [m._get_root_mesh() if hasattr(m, "_get_root_mesh") else m for m in meshes]
    root = roots[0]
    grid = root.mesh
    for m, r in zip(meshes, roots):
        if not torch.equal(r.mesh, grid):
            raise ValueError(
                f"the parameters live on meshes of different roots ({grid.tolist()} and {r.mesh.tolist()}); "
                "one optimizer takes the parameters of one device mesh (and its sub-meshes)"
            )
    where = {int(grid[idx]): idx for idx in itertools.product(*[range(n) for n in grid.shape])}
    me = where[dist.get_rank()]
    spanned = set()
    for m in meshes:
        for r in m.mesh.flatten().tolist():
            spanned.update(k for k in range(grid.ndim) if where[int(r)][k] != me[k])
    fixed = [k for k in range(grid.ndim) if k not in spanned]
    ranks = tuple(r for r, c in sorted(where.items(), key=lambda kv: kv[1]) if all(c[k] == me[k] for k in fixed))
    if list(ranks) != sorted(ranks):
        raise ValueError(
            f"the device mesh {grid.tolist()} is not laid out in increasing rank order; distmuon needs "
            "it so (as init_device_mesh makes it)"
        )
    return _World(ranks, root, tuple(sorted(spanned)))


def _replicas(size: int, shard_sizes: list[int], holdings: list[tuple[Holding, ...]]) -> int:
    """The most HSDP replicas the engine can take: the product of the leading spanned mesh dims
    across which every parameter is held alike (members r * shard + s hold what s holds)."""
    best, r = 1, 1
    for n in shard_sizes[:-1]:
        r *= n
        shard = size // r
        if all(h[m] == h[m % shard] for h in holdings for m in range(size)):
            best = r
        else:
            break
    return best


def layout_topology(params: list[Any], names: list[str], mode: str) -> Topology:
    """The engine's world for DTensor parameters on several meshes of one root, or placed other
    than FSDP2's dim-0 sharding: every rank's box of every parameter, exchanged once (collective
    over the members); errors are raised alike on every member."""
    from distmuon.torch._dist import agree

    if mode == "gather":
        raise ValueError(
            "dist_mode='gather' takes FSDP2's dim-0 sharding on one mesh; tensor- and expert-parallel "
            "parameters step in the sharded mode (dist_mode='auto')"
        )
    world = _world([p.device_mesh for p in params])
    ranks = world.ranks
    if list(ranks) == list(range(dist.get_world_size())):
        group = dist.group.WORLD
    else:
        group = dist.new_group(list(ranks), use_local_synchronization=True)
    member = ranks.index(dist.get_rank())
    error, mine = None, []
    for p, n in zip(params, names):
        try:
            mine.append(own_holding(n, p))
        except ValueError as e:
            error = error or str(e)
            mine.append(None)
    probe = Topology("sharded", group, ranks, member)
    signature = repr([(n, tuple(p.shape)) for p, n in zip(params, names)])
    agree(probe, error, "placing the parameters on the mesh", fingerprint=signature)
    everyone: list[Any] = [None] * len(ranks)
    dist.all_gather_object(everyone, mine, group=group)
    holdings = [tuple(everyone[q][i] for q in range(len(ranks))) for i in range(len(params))]
    replicate = _replicas(len(ranks), [world.root.size(k) for k in world.dims], holdings)
    groups = tuple(world.root.get_group(k) for k in world.dims)
    coords = hsdp_coords(len(ranks), replicate, range(len(ranks)))
    layouts = {id(p): h for p, h in zip(params, holdings)}
    return Topology("sharded", group, ranks, member, replicate, world.root, groups, coords, layouts)


def take(full: torch.Tensor, h: Holding) -> torch.Tensor:
    """The box `h` of a whole tensor (a checkpoint's full tensor loaded on the layout path)."""
    for d, runs in enumerate(h):
        idx = [i for a, b in runs for i in range(a, b)]
        full = full.index_select(d, torch.tensor(idx, dtype=torch.int64, device=full.device))
    return full

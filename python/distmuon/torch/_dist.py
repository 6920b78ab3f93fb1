"""Where the parameters live across processes, detected from the parameters themselves.

- DTensor parameters (FSDP2 ``fully_shard``): the engine's sharded mode over the parameters'
  device mesh. A 1D mesh with ``Shard(0)`` is FSDP; a 2D mesh with ``(Replicate(), Shard(0))``
  is HSDP (replicate x shard). Parameters on several sub-meshes of one mesh, or placed by tensor
  or expert parallelism (``parallelize_module``, experts split over an ``ep`` dim), step in the
  same mode over the whole mesh through ``_layout``.
- Plain parameters while torch.distributed is initialised with more than one process: the
  replicated mode (DDP: every rank holds the same full parameters and, after backward, the same
  averaged gradients).
- Otherwise one process.

The engine's world ("members") is a torch process group whose group ranks are the member
indices; in HSDP member ``r * shard + s`` is at replica ``r``, shard position ``s``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distmuon import _C

MODES = ("auto", "local", "replicated", "sharded", "gather")


def is_dtensor(t: object) -> bool:
    return type(t).__name__ == "DTensor"


def local_tensor(t: Any) -> torch.Tensor:
    """The local part of a DTensor without autograd bookkeeping: DTensor's own attribute costs
    0.04 us where ``to_local()`` costs about 4 us, which adds up over hundreds of parameters
    and gradients per step."""
    local = getattr(t, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else t.to_local()


@dataclass(frozen=True)
class Topology:
    """The engine's world as this process sees it."""

    mode: str  # 'local' | 'replicated' | 'sharded' | 'gather' | 'dedicated'
    group: Any = None  # torch ProcessGroup of the members (None: one process)
    ranks: tuple[int, ...] = (0,)  # global rank of each member, in member order
    member: int = 0  # this process's member index
    replicate: int = 1  # HSDP replicas; shard groups have size // replicate members
    mesh: Any = None  # the parameters' DeviceMesh (sharded modes)
    mesh_groups: tuple[Any, ...] = field(default=())  # the mesh's per-dimension groups
    # Sharded modes: (replica, shard position) of each member on the mesh.
    coords: tuple[tuple[int, int], ...] = field(default=())
    # Tensor / expert parallel layouts (``_layout``): id(param) -> every member's box of it;
    # None when the parameters are FSDP2's dim-0 shards of one mesh.
    layouts: dict[int, Any] | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def distributed(self) -> bool:
        return self.mode != "local"

    @property
    def sharded(self) -> bool:
        return self.mode in ("sharded", "gather")

    @property
    def shard_size(self) -> int:
        return self.size // self.replicate

    def shard_position(self, member: int) -> int:
        return self.coords[member][1] if self.coords else member

    def replica(self, member: int) -> int:
        return self.coords[member][0] if self.coords else 0


def hsdp_coords(size: int, replicate: int, positions: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """(replica, shard position) of each of `positions` (indices in the replicate x shard order
    of a world of `size`), as the engine places them (``_C.HsdpWorld``, distmuon/hsdp.h)."""
    world = _C.HsdpWorld(size, replicate, 0)
    return tuple(tuple(world.coords(q)) for q in positions)  # type: ignore[misc]


def chunk_rows(dim0: int, parts: int, index: int) -> tuple[int, int]:
    """(row_begin, row_count) of chunk `index` when dim 0 is cut as torch.chunk cuts it (FSDP2's
    Shard(0): ceil(dim0 / parts) rows per chunk, trailing chunks short or empty)."""
    size = math.ceil(dim0 / parts)
    begin = min(index * size, dim0)
    return begin, max(0, min(dim0, begin + size) - begin)


def _fsdp_native(p: Any) -> bool:
    """FSDP2's dim-0 sharding: (Shard(0),) on a 1D mesh or (Replicate(), Shard(0)) on a 2D
    (HSDP) mesh. Other placements and several meshes take the layout path (``_layout``)."""
    from torch.distributed.tensor import Replicate, Shard

    pl = tuple(p.placements)
    shard0 = len(pl) >= 1 and type(pl[-1]) is Shard and pl[-1].dim == 0
    return shard0 and (p.device_mesh.ndim == 1 or (p.device_mesh.ndim == 2 and type(pl[0]) is Replicate))


def local_rows(name: str, p: Any) -> tuple[int, int]:
    """The dim-0 rows [begin, begin + count) this rank holds of DTensor parameter `p`."""
    mesh = p.device_mesh
    begin, count = chunk_rows(p.shape[0], mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1))
    local = p.to_local()
    if local.shape[0] != count or tuple(local.shape[1:]) != tuple(p.shape[1:]):
        raise ValueError(
            f"parameter '{name}': the local shard has shape {tuple(local.shape)} where FSDP2's "
            f"Shard(0) of {tuple(p.shape)} gives {count} rows here; distmuon needs torch.chunk-style "
            "dim-0 shards"
        )
    return begin, count


def _world_of_mesh(mesh: Any) -> tuple[Any, tuple[int, ...]]:
    """A process group whose group ranks follow the mesh's row-major order."""
    flat = [int(r) for r in mesh.mesh.flatten().tolist()]
    if mesh.ndim == 1:
        group = mesh.get_group(0)
        ranks = tuple(dist.get_process_group_ranks(group))
        return group, ranks
    if flat != sorted(flat):
        raise ValueError(
            f"the HSDP mesh {mesh.mesh.tolist()} is not laid out in increasing rank order; distmuon "
            "needs mesh[r][s] increasing in r * shard + s (as init_device_mesh makes it)"
        )
    if flat == list(range(dist.get_world_size())):
        return dist.group.WORLD, tuple(flat)
    return dist.new_group(flat, use_local_synchronization=True), tuple(flat)


def detect(
    params: list[torch.Tensor], names: list[str], mode: str, process_group: Any = None, layout: bool = False
) -> Topology:
    """The Topology of `params` (all of one optimizer), or a ValueError saying what does not fit.

    `mode` overrides the detection: 'local' (no communication), 'replicated', 'sharded' or
    'gather' (the naive baseline of sharded parameters); 'auto' detects. `layout` takes the
    layout path (``_layout``) for DTensors even on FSDP2's own sharding (matrices cut into row
    blocks, whose rows FSDP2's shards cut through).
    """
    if mode not in MODES:
        raise ValueError(f"dist_mode must be one of {', '.join(MODES)} (got {mode!r})")
    dts = [is_dtensor(p) for p in params]
    if any(dts):
        if not all(dts):
            i, j = dts.index(True), dts.index(False)
            raise ValueError(
                f"parameter '{names[i]}' is a DTensor (FSDP2) but '{names[j]}' is a plain tensor; "
                "shard every module of the model (fully_shard on the root too) or give the plain "
                "parameters their own optimizer"
            )
        if mode in ("local", "replicated"):
            raise ValueError(f"dist_mode={mode!r} takes plain tensors, but the parameters are DTensors (FSDP2)")
        if process_group is not None:
            raise ValueError("process_group is for plain (DDP) parameters; DTensor parameters bring their mesh")
        mesh = params[0].device_mesh
        if layout or any(p.device_mesh != mesh or not _fsdp_native(p) for p in params):
            from distmuon.torch._layout import layout_topology

            return layout_topology(params, names, mode)  # tensor / expert parallelism, sub-meshes
        group, ranks = _world_of_mesh(mesh)
        member = ranks.index(dist.get_rank())
        replicate = mesh.size(0) if mesh.ndim == 2 else 1
        groups = tuple(mesh.get_group(d) for d in range(mesh.ndim))
        flat = [int(r) for r in mesh.mesh.flatten().tolist()]
        coords = hsdp_coords(len(flat), replicate, (flat.index(r) for r in ranks))
        kind = "gather" if mode == "gather" else "sharded"
        return Topology(kind, group, ranks, member, replicate, mesh, groups, coords)
    if mode in ("sharded", "gather"):
        raise ValueError(f"dist_mode={mode!r} needs DTensor parameters (FSDP2 fully_shard)")
    initialised = dist.is_available() and dist.is_initialized()
    if mode == "local" or not initialised:
        if mode == "replicated":
            raise ValueError("dist_mode='replicated' needs torch.distributed to be initialised")
        return Topology("local")
    group = process_group if process_group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(group))
    if len(ranks) == 1 and mode == "auto":
        return Topology("local")
    return Topology("replicated", group, ranks, ranks.index(dist.get_rank()))


def agree(topo: Topology, local_error: str | None, what: str, fingerprint: str = "") -> None:
    """Raises on every member when any member has an error or a different `fingerprint` (so
    that none is left waiting in a collective the others never join, or joins one with other
    arguments). One small exchange; no-op in a single process."""
    if not topo.distributed:
        if local_error:
            raise ValueError(local_error)
        return
    mine = (local_error, fingerprint)
    everyone: list[Any] = [None] * topo.size
    dist.all_gather_object(everyone, mine, group=topo.group)
    bad = [(q, e) for q, (e, _) in enumerate(everyone) if e]
    if not bad:
        differ = [q for q, (_, f) in enumerate(everyone) if f != everyone[0][1]]
        if not differ:
            return
        q = differ[0]
        bad = [(q, f"has {everyone[q][1]!r} where rank {topo.ranks[0]} has {everyone[0][1]!r}")]
    lines = "\n".join(f"  rank {topo.ranks[q]}: {e}" for q, e in bad)
    raise ValueError(f"{what} failed on {len(bad)} of {topo.size} ranks; nothing was changed:\n{lines}")

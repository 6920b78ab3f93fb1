"""What ``dedicate()`` decides once: the dedicated world (replicate x shard ranks), which
matrices, their owners (the engine's planner), and from the engine's layout (distmuon/dedicated.h:
the planner's layer rule) the layer ("unit") each belongs to and the flat buffers that make one
broadcast per owner per layer; and the memory the engine's transfers move
(distmuon/dedicated_transfers.h), which stays here and is lent to them.

Every dedicated parameter becomes a view into the flat buffer of its (unit, owner) bucket. The
ranks that keep a bucket between steps hold its storage: the owner and, in HSDP, the ranks at
the owner's shard position of the other replicas (they relay it inside their shard group). On
every other rank the storage is freed (resized to 0) and only materialised around its use.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distmuon import _C
from distmuon.torch._device import gpu_ranks_per_node, to_dlpack
from distmuon.torch._options import engine_dtype


@dataclass(frozen=True)
class Grid:
    """The dedicated world: the engine's description of it (``_C.HsdpWorld``, distmuon/hsdp.h:
    replicate x shard members, each member's replica and shard position), and the global rank
    of each member."""

    ranks: tuple[int, ...]  # global rank of each member
    world: Any  # _C.HsdpWorld

    @staticmethod
    def of(table: list[list[int]]) -> Grid:
        """The grid of a replicate x shard table of global ranks (``table[r][s]``), this rank in it."""
        world = _C.HsdpWorld(len(table) * len(table[0]), len(table), 0)
        ranks = [-1] * world.size
        for r, row in enumerate(table):
            for s, rank in enumerate(row):
                ranks[world.at(r, s)] = int(rank)
        member = ranks.index(dist.get_rank())
        return Grid(tuple(ranks), _C.HsdpWorld(world.size, world.replicate, member))

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def replicate(self) -> int:
        return self.world.replicate

    @property
    def member(self) -> int:
        return self.world.member


@dataclass
class Groups:
    """Process groups of the dedicated traffic, apart from FSDP's so that collectives issued at
    different moments of backward never interleave with its own."""

    world: Any = None  # every member: the engine's world
    shard: Any = None  # my shard group (replica r, all positions)
    replica: Any = None  # my replica group (position s, all replicas)
    control: Any = None  # gloo over every member: the small vote of each step


@dataclass
class Matrix:
    """One dedicated parameter (one engine matrix)."""

    index: int
    name: str
    param: nn.Parameter
    rows: int
    cols: int
    owner: int = 0  # member
    unit: int = 0
    bucket: int = 0
    offset: int = 0  # elements into the bucket's flat buffer

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def numel_of_param(self) -> int:
        """Elements of the parameter in its bucket's buffers (the layout's numel)."""
        return self.param.numel()


@dataclass
class Bucket:
    """The matrices of one unit owned by one member: one flat buffer, one broadcast."""

    unit: int
    owner: int
    matrices: list[int]
    flat: torch.Tensor
    kept: bool  # this rank holds it between steps (owner, or HSDP relay)
    # The owner's gradient buffer of the last reduction (its matrices' .grad are views of it),
    # weakly: the views keep it alive; once zero_grad sets them to None it is freed, as the
    # gradients were before.
    grad_flat: weakref.ref | None = None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def held(self) -> bool:
        return self.flat.untyped_storage().nbytes() > 0

    def materialise(self) -> None:
        if not self.held():
            self.flat.untyped_storage().resize_(self.nbytes)

    def free(self) -> None:
        if not self.kept and self.held():
            self.flat.untyped_storage().resize_(0)


@dataclass
class Unit:
    """A layer: the module whose forward needs the matrices (broadcast before it runs)."""

    prefix: str
    module: nn.Module
    matrices: list[int] = field(default_factory=list)
    buckets: list[int] = field(default_factory=list)


class Memory:
    """The memory the engine's transfers move (DedicatedMemory), which stays here.

    Gradients are lent rather than asked for on backward's path: each dedicated gradient's hook
    copies it into its bucket's flat gradient buffer (``lend``), the bucket's first gradient
    lending that buffer to the transfers, whose one reduction of the bucket then takes it as it
    is. The owner keeps its gradients as views of the buffer, other ranks drop theirs as they
    lend them (the transfers hold the buffer until the collective is done). The transfers ask for
    a bucket's weights when a forward stage needs them (``bucket``: materialised on demand), and
    at step() for what backward did not lend (``grads``) and who has a gradient (``has_grad``);
    the buckets whose weights they release come back from the stage that released them."""

    def __init__(self, matrices: list[Matrix], buckets: list[Bucket], member: int) -> None:
        self.matrices, self.buckets, self.member = matrices, buckets, member
        # Per bucket: the gradient buffer lent for its next reduction, and the matrices whose
        # gradient is in it.
        self.lent: list[torch.Tensor | None] = [None] * len(buckets)
        self.adopted: list[set[int]] = [set() for _ in buckets]

    def bucket(self, b: int) -> Any:
        bucket = self.buckets[b]
        bucket.materialise()
        return to_dlpack(bucket.flat)

    def free(self, released: list[int]) -> None:
        """The transfers released these buckets' weights."""
        for b in released:
            self.buckets[b].free()

    def lend(self, j: int) -> Any:
        """Matrix j's gradient into its bucket's lent buffer (before its hook reports it ready):
        copied, or added where an earlier backward's is in it already (a second synchronised
        backward before the bucket went: autograd's accumulation), unless it is a view there
        already. Returns the buffer as a DLPack capsule when it is lent now, else None."""
        m = self.matrices[j]
        b = m.bucket
        flat, fresh = self.lent[b], None
        if flat is None:
            flat = self.lent[b] = self._buffer(b)
            fresh = to_dlpack(flat)
        adopted = self.adopted[b]
        if not self._is_view(j, flat):
            view = flat[m.offset : m.offset + m.numel_of_param]
            g = m.param.grad
            assert g is not None, "a gradient hook without a gradient"
            if j in adopted:
                view.add_(g.reshape(-1))
            else:
                view.copy_(g.reshape(-1))
            # The owner's gradient becomes the view; other ranks drop theirs (the transfers keep
            # the buffer alive while it travels).
            m.param.grad = view.view(m.param.shape) if self.buckets[b].owner == self.member else None
        adopted.add(j)
        return fresh

    def sent(self, buckets: list[int]) -> None:
        """These buckets' lent buffers went into a reduction: the next gradient lends anew."""
        for b in buckets:
            self.lent[b], self.adopted[b] = None, set()

    def reset(self) -> None:
        """The transfers' step is over (finish()): nothing stays lent."""
        self.sent(list(range(len(self.buckets))))

    def grads(self, b: int, present: list[int]) -> Any:
        """At step(): bucket b's gradients as one flat buffer for its reduction, where backward did
        not lend them all: the lent buffer (or, as for a first lend, the owner's buffer when its
        gradients are views of it, else a fresh one), completed with this rank's gradient of
        every `present` matrix not in it yet and zeros for the rest (copies queued on the current
        stream: no host wait). The owner keeps the `present` matrices' gradients as views of
        it, other ranks drop them."""
        bucket = self.buckets[b]
        flat, adopted = self.lent[b], self.adopted[b]
        self.sent([b])
        if flat is None:
            flat = self._buffer(b)
        keep = set(present)
        for j in bucket.matrices:
            if j in adopted or self._is_view(j, flat):
                continue
            m = self.matrices[j]
            view = flat[m.offset : m.offset + m.numel_of_param]
            g = m.param.grad if j in keep else None
            if g is None:
                view.zero_()
            else:
                view.copy_(g.reshape(-1))
        self._hand_over(b, present, flat)
        return to_dlpack(flat)

    def has_grad(self, j: int) -> bool:
        return self.matrices[j].param.grad is not None

    def _buffer(self, b: int) -> torch.Tensor:
        """A gradient buffer for bucket b: the owner's of its last reduction where every gradient
        of the bucket still is its view (after zero_grad(set_to_none=False)), else a fresh one,
        which the owner holds weakly (its gradients, views of it, keep it alive; zero_grad()
        then frees it, as it freed the gradients before)."""
        bucket = self.buckets[b]
        held = bucket.grad_flat() if bucket.grad_flat is not None else None
        if held is not None and all(self._is_view(j, held) for j in bucket.matrices):
            return held
        first = self.matrices[bucket.matrices[0]].param
        flat = torch.empty(bucket.flat.numel(), dtype=first.dtype, device=first.device)
        if bucket.owner == self.member:
            bucket.grad_flat = weakref.ref(flat)
        return flat

    def _hand_over(self, b: int, js: list[int], flat: torch.Tensor) -> None:
        """The owner's gradients of js become views of `flat` (the reduction writes the sums
        there); other ranks drop theirs (the transfers keep `flat` alive while it travels)."""
        owner = self.buckets[b].owner == self.member
        for j in js:
            m = self.matrices[j]
            if not owner:
                m.param.grad = None
            elif not self._is_view(j, flat):
                m.param.grad = flat[m.offset : m.offset + m.numel_of_param].view(m.param.shape)

    def _is_view(self, j: int, flat: torch.Tensor) -> bool:
        m = self.matrices[j]
        g = m.param.grad
        return (
            g is not None
            and g.is_contiguous()
            and g.dtype == flat.dtype
            and g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            and g.data_ptr() == flat.data_ptr() + m.offset * flat.element_size()
        )


def make_grid(mesh: Any, replicate_mesh: Any) -> Grid:
    """The Grid of a 1D mesh (flat), a 2D (replicate, shard) mesh, or a 1D shard mesh with a 1D
    replicate mesh."""
    if mesh is None:
        raise ValueError("dedicate() needs a DeviceMesh (torch.distributed initialised; a 1-rank mesh for one process)")
    if replicate_mesh is not None:
        if mesh.ndim != 1 or replicate_mesh.ndim != 1:
            raise ValueError("with replicate_mesh, mesh must be the 1D shard mesh and replicate_mesh 1D")
        rs = (replicate_mesh.get_local_rank(), mesh.get_local_rank())
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (dist.get_rank(), rs, mesh.size(), replicate_mesh.size()))
        R, S = replicate_mesh.size(), mesh.size()
        grid = [[-1] * S for _ in range(R)]
        for rank, (r, s), s_size, r_size in everyone:
            if s_size == S and r_size == R:
                grid[r][s] = rank
        if any(x < 0 for row in grid for x in row):
            raise ValueError(f"the shard and replicate meshes do not form a {R} x {S} grid: {grid}")
        return Grid.of(grid)
    if mesh.ndim == 1:
        return Grid.of([mesh.mesh.tolist()])
    if mesh.ndim == 2:
        return Grid.of(mesh.mesh.tolist())
    raise ValueError(f"dedicate() takes a 1D mesh or a 2D (replicate, shard) mesh, not {mesh.ndim}D")


def make_groups(grid: Grid) -> Groups:
    """New process groups over the grid (collective over the default group; one rank: only the
    engine's world, made by that rank alone)."""
    if grid.size == 1:
        return Groups(world=dist.new_group(list(grid.ranks), use_local_synchronization=True))
    w = grid.world
    g = Groups(world=dist.new_group(list(grid.ranks)))
    g.control = dist.new_group(list(grid.ranks), backend="gloo")
    if w.replicate == 1:
        g.shard = g.world
        return g
    shards = [[grid.ranks[q] for q in w.shard_group(r)] for r in range(w.replicate)]
    replicas = [[grid.ranks[q] for q in w.replica_group(s)] for s in range(w.shard)]
    g.shard, _ = dist.new_subgroups_by_enumeration(shards)
    g.replica, _ = dist.new_subgroups_by_enumeration(replicas)
    return g


def plan(matrices: list[Matrix], grid: Grid, groups: Groups, device: torch.device, planner: str) -> dict[str, Any]:
    """Owners from the engine's planner (balanced on costs, layers spread), computed by member 0
    (on its costs: DISTMUON_PLAN_COSTS, its measurement store) and shared, so that every rank
    holds the same plan. Member 0's error (a corrupt store, an unknown planner) is raised on
    every member."""
    result: list[Any] = [None]
    if grid.member == 0:
        opts = _C.DistOptions()
        opts.planner = planner
        if device.type == "cuda":
            opts.gpus_per_node = gpu_ranks_per_node()
        ortho = _C.parse_algorithm("auto", _C.OrthoConfig())
        ortho.work_dtype = _C.DType.bf16 if device.type == "cuda" else _C.DType.f32
        try:
            result[0] = _C.plan_owners(
                [m.name for m in matrices], [[m.rows, m.cols] for m in matrices], 4, grid.size, grid.replicate,
                opts, ortho, device.type,
            )
        except Exception as e:  # noqa: BLE001 - raised on every member below
            result[0] = f"{type(e).__name__}: {e}"
    if grid.size > 1:
        dist.broadcast_object_list(result, src=grid.ranks[0], group=groups.control)
    if isinstance(result[0], str):
        raise RuntimeError(f"dedicate(): planning the owners failed on member 0: {result[0]}")
    return result[0]


def lay_out(model: nn.Module, matrices: list[Matrix], grid: Grid) -> tuple[list[Unit], list[Bucket], Any]:
    """The units (in forward order: the order of the modules) and buckets of the engine's layout
    of the owned matrices, and the layout itself; each parameter becomes a view into its
    bucket's flat buffer and the storage of buckets this rank does not keep is freed."""
    layout = _C.dedicated_layout(
        [m.name for m in matrices], [m.param.numel() for m in matrices],
        [engine_dtype(m.param.dtype) for m in matrices], [m.owner for m in matrices],
        [name for name, _ in model.named_modules()], grid.world,
    )
    units = [Unit(u.module, model.get_submodule(u.module), list(u.matrices), list(u.buckets)) for u in layout.units]
    for j, m in enumerate(matrices):
        m.unit, m.bucket, m.offset = layout.unit_of[j], layout.bucket_of[j], layout.offset[j]
    buckets: list[Bucket] = []
    for b in layout.buckets:
        first = matrices[b.matrices[0]].param
        flat = torch.empty(b.numel, dtype=first.dtype, device=first.device)
        for j in b.matrices:
            m = matrices[j]
            view = flat[m.offset : m.offset + m.param.numel()]
            view.copy_(m.param.detach().reshape(-1))
            m.param.data = view.view(m.param.shape)
        bucket = Bucket(b.unit, b.owner, list(b.matrices), flat, b.kept)
        bucket.free()
        buckets.append(bucket)
    return units, buckets, layout


def collect(model: nn.Module, predicate: Any, muon_shape: Any) -> list[Matrix]:
    """The selected parameters, named as model.named_parameters() names them."""
    matrices: list[Matrix] = []
    for name, p in model.named_parameters():
        if not predicate(name, p):
            continue
        if not p.requires_grad:
            raise ValueError(f"dedicate(): parameter '{name}' does not require grad; select only trained matrices")
        if p.dim() < 2:
            raise ValueError(
                f"dedicate(): parameter '{name}' of shape {tuple(p.shape)} is not a matrix; a dedicated parameter is "
                "a matrix (2-D, or a convolution kernel) that Muon steps: the predicate must not select biases, "
                "norms or other vectors"
            )
        rows, cols, count = muon_shape(name, p)
        if count != 1:
            raise ValueError(
                f"dedicate(): parameter '{name}' of shape {tuple(p.shape)} holds {count} matrices; a dedicated "
                "parameter is one matrix owned whole (leave stacked matrices to FSDP2)"
            )
        matrices.append(Matrix(len(matrices), name, p, rows, cols))
    if not matrices:
        raise ValueError("dedicate(): the predicate selected no parameter")
    return matrices

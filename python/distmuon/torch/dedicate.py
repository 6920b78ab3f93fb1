"""distmuon.torch.dedicate: the DMuon runtime for FSDP2 and HSDP (docs/algorithms.md section 6).

Selected matrices are owned whole by one rank each (the engine's planner, balanced on costs).
FSDP2 leaves them alone (``fully_shard(..., ignored_params=dm.ignored_params)``); the owner keeps
the weight, its momentum and its CacheMuon entry, and no other rank keeps the weight between
steps:

- forward: before a layer runs, each owner broadcasts its matrices of that layer in one call
  (one flat buffer per owner per layer), the next layer's already in flight;
- backward: as soon as the gradients of a layer's matrices of one owner are complete they are
  reduced to that owner as one flat buffer, one collective (HSDP: in the shard group, then one
  across replicas), while backward goes on, and the other ranks free their copy of the weights
  and their gradients; with ``overlap_step`` the owner then runs momentum and
  orthogonalization of each layer it has completely received (on a side stream on CUDA), so
  that ``step()`` only applies the updates of those;
- HSDP: after the step each owner sends its updated weights to its replicas asynchronously.

The data movement is the engine's (distmuon/dedicated_transfers.h, over the communicator made
here, which the optimizer's dedicated engine shares); this module keeps the PyTorch hooks that
call its stages, and the memory (bucket storage, gradients) they move.

``distmuon.torch.Muon`` built on the model (after ``fully_shard``) finds these parameters and
steps them in the engine's dedicated mode; its checkpoints have the format of the other modes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from distmuon import _C
from distmuon.torch._dedicated_layout import (
    Bucket,
    Grid,
    Groups,
    Matrix,
    Memory,
    Unit,
    collect,
    lay_out,
    make_grid,
    make_groups,
    plan,
)
from distmuon.torch._device import check_communicator, make_communicator, to_dlpack
from distmuon.torch._dist import Topology, hsdp_coords
from distmuon.torch._options import engine_dtype
from distmuon.torch._params import default_muon_filter, matrix_shape, module_param_infos
from distmuon.torch._torch_comm import TorchCollectives

# The attribute by which a dedicated parameter names its handle (a weak reference), so that the
# optimizer finds it. (Tensors are no dictionary keys: their == is elementwise.) The model keeps
# the handle alive under the same name: callers need not hold what dedicate() returns (at one
# rank no hook refers to it).
_MARK = "_distmuon_dedicated"

Predicate = Callable[[str, nn.Parameter], bool]


def handle_of(p: torch.Tensor) -> Dedicated | None:
    """The Dedicated handle that owns parameter `p`, if any."""
    ref = getattr(p, _MARK, None)
    if not isinstance(ref, weakref.ref):
        return None
    handle = ref()
    if handle is None:
        raise RuntimeError(
            "this parameter was dedicated (distmuon.torch.dedicate) but its handle is gone with the "
            "model that held it; give the optimizer the parameters of a live dedicated model"
        )
    return handle


def _weak_grad_hook(dedicated: weakref.ref[Dedicated], j: int) -> Callable[[torch.Tensor], None]:
    def hook(p: torch.Tensor) -> None:
        d = dedicated()
        if d is not None:
            d._grad_ready(j)

    return hook


class Dedicated:
    """What ``dedicate()`` returns: the dedicated matrices, their owners and the runtime's hooks."""

    def __init__(
        self, model: nn.Module, grid: Grid, groups: Groups, matrices: list[Matrix], units: list[Unit],
        buckets: list[Bucket], layout: Any, plan_info: dict[str, Any], overlap_step: bool, communicator: str,
    ) -> None:
        self.grid, self.groups, self.matrices, self.units, self.buckets = grid, groups, matrices, units, buckets
        self.plan = plan_info
        self.overlap_step = overlap_step
        self.device = matrices[0].param.device
        self.cuda = self.device.type == "cuda"
        self.side = torch.cuda.Stream(self.device) if self.cuda else None
        # The engine's communicator of the dedicated world (the optimizer's dedicated engine
        # shares it) and a host one for the vote of each step; none in one process.
        self.comm: Any = None
        control = None
        if grid.size > 1:
            self.comm = make_communicator(self.topology(), self.device, communicator, groups.control)
            control = _C.make_python_communicator(
                TorchCollectives(groups.control, torch.device("cpu")), grid.member, grid.size,
                "torch-gloo:dedicated-control", list(grid.ranks),
            )
        self.memory = Memory(matrices, buckets, grid.member)
        with torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
            self.transfers = _C.DedicatedTransfers(
                layout, [m.name for m in matrices], [m.numel for m in matrices],
                [engine_dtype(m.param.dtype) for m in matrices], [m.owner for m in matrices],
                grid.world, self.comm, control, self.memory, self._stream(),
                self.device.type, self.device.index or 0,
            )
        self._sync = True
        self._prepare: Callable[[list[nn.Parameter], Any], None] | None = None
        self._discard: Callable[[], None] | None = None
        self._index = {id(m.param): m.index for m in matrices}
        self._handles: list[Any] = []
        self._install(model)
        model.__dict__[_MARK] = self  # a plain attribute: not a submodule, not in state_dict
        for m in matrices:
            setattr(m.param, _MARK, weakref.ref(self))

    # ---- public ---------------------------------------------------------------------------------

    @property
    def ignored_params(self) -> set[nn.Parameter]:
        """Pass to ``fully_shard(..., ignored_params=...)`` (every call) so FSDP2 leaves them."""
        return {m.param for m in self.matrices}

    @property
    def owners(self) -> dict[str, int]:
        """Global rank that owns each dedicated parameter, by name."""
        return {m.name: self.grid.ranks[m.owner] for m in self.matrices}

    def topology(self) -> Topology:
        """The engine's world for the dedicated part of an optimizer."""
        g = self.grid
        coords = hsdp_coords(g.size, g.replicate, range(g.size))
        mesh_groups = tuple(x for x in (self.groups.shard, self.groups.replica) if x is not None)
        return Topology("dedicated", self.groups.world, g.ranks, g.member, g.replicate, None, mesh_groups, coords)

    def owner_members(self, params: list[torch.Tensor]) -> list[int]:
        """The owner (member) of each parameter, for DistOptions.owners."""
        return [self.matrices[self._index[id(p)]].owner for p in params]

    def set_requires_gradient_sync(self, sync: bool) -> None:
        """False: backward only accumulates gradients locally (micro-batches before the last,
        as FSDP2's method of the same name); the next synchronised backward, or step(),
        reduces what accumulated."""
        self._sync = bool(sync)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside do not reduce."""
        old = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = old

    def memory_stats(self) -> dict[str, int]:
        """Bytes of dedicated weights: held now by this rank, kept between steps, and in all."""
        held = sum(b.nbytes for b in self.buckets if b.held())
        kept = sum(b.nbytes for b in self.buckets if b.kept)
        total = sum(b.nbytes for b in self.buckets)
        return {"held_bytes": held, "kept_bytes": kept, "total_bytes": total}

    def wait(self) -> None:
        """Completes the HSDP publication of the last step (forward does it before use)."""
        self.transfers.wait_published(self._stream())

    def remove(self) -> None:
        """Removes the hooks (the parameters stay views of their buckets)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- hooks ----------------------------------------------------------------------------------

    def _install(self, model: nn.Module) -> None:
        if self.grid.size > 1:
            self._handles.append(model.register_forward_pre_hook(self._begin_forward))
            for k, unit in enumerate(self.units):
                self._handles.append(unit.module.register_forward_pre_hook(self._before_unit(k)))
                self._handles.append(unit.module.register_forward_hook(self._after_unit(k)))
            # torch marks these hooks with an attribute: plain functions, not bound methods
            self._handles.append(model.register_state_dict_post_hook(lambda *a: self._full_state_dict(*a)))
            self._handles.append(model.register_load_state_dict_pre_hook(lambda *a: self._before_load(*a)))
            self._handles.append(model.register_load_state_dict_post_hook(lambda *a: self._after_load(*a)))
        if self.grid.size > 1 or self.overlap_step:
            # A tensor's hooks are not always visited by Python's cycle collector (torch skips a
            # tensor that C++ also holds), so a hook that held `self` would keep the model, this
            # object, the optimizer and their NCCL communicators alive for the whole process:
            # the parameters' hooks reach `self` through a weak reference.
            me = weakref.ref(self)
            for m in self.matrices:
                self._handles.append(m.param.register_post_accumulate_grad_hook(_weak_grad_hook(me, m.index)))

    def _stream(self) -> int:
        """torch's current stream, which the transfers' stages order their results on."""
        return int(torch.cuda.current_stream(self.device).cuda_stream) if self.cuda else 0

    def _begin_forward(self, module: nn.Module, args: Any) -> None:
        self.transfers.begin_forward()
        self.transfers.issue(0, self._stream())

    def _before_unit(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            stream = self._stream()
            self.transfers.wait_unit(k, stream)
            self.transfers.issue(k + 1, stream)  # prefetch: the next layer travels while this one runs

        return hook

    def _after_unit(self, k: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():  # no backward will use them
                self.memory.free(self.transfers.release_unit(k))

        return hook

    def _grad_ready(self, j: int) -> None:
        """Matrix j's gradient is complete (its parameter's post-accumulate-grad hook)."""
        if self._sync:
            # The gradient goes into its bucket's buffer here, lent to the transfers with the
            # bucket's first one: the reduction they issue asks nothing of Python.
            lent = self.memory.lend(j)
            landed, sent = self.transfers.grad_ready(j, self._stream(), lent)
            if sent:
                self.memory.sent(sent)
            for js in landed:
                self._landed(js)
        bucket = self.matrices[j].bucket
        if self.grid.size > 1 and self.transfers.used(bucket):
            self.buckets[bucket].free()

    def _landed(self, js: list[int]) -> None:
        """Owner: the reduced gradients of its matrices of one layer are in (or on their way, on
        CUDA): their momentum and orthogonalization start now, unless left to step()."""
        if not self.overlap_step or self._prepare is None:
            return
        params = [self.matrices[j].param for j in js]
        if not all(p.grad is not None and p.grad.is_contiguous() for p in params):
            return  # unusual layouts: step() copies them
        # wait() completes the reductions and turns the owner's sums into means (in C++).
        if self.side is None:
            self.transfers.wait(js, 0)
            self._prepare(params, None)
        else:
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                self.transfers.wait(js, int(self.side.cuda_stream))
                for p in params:
                    assert p.grad is not None
                    p.grad.record_stream(self.side)
                self._prepare(params, self.side)
        self.transfers.prepared(js)

    # ---- the optimizer's side -------------------------------------------------------------------

    def bind(self, prepare: Callable[[list[nn.Parameter], Any], None] | None, discard: Callable[[], None]) -> None:
        """The optimizer's entries for early momentum and orthogonalization (overlap_step) and
        for forgetting it when a step is abandoned."""
        self._prepare, self._discard = prepare, discard

    def before_step(self) -> None:
        """Every reduction done and waited (owners hold mean gradients), early work ordered
        before the step on CUDA."""
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        stream = self._stream()
        try:
            self.transfers.finish(stream)  # the owners' sums become means there (in C++)
        except RuntimeError:
            if self._discard is not None:
                self._discard()
            self.memory.free(self.transfers.release_all(stream))
            raise
        finally:
            self.memory.reset()

    def after_step(self) -> None:
        """Non-owners' copies go; HSDP owners publish to their replicas."""
        stream = self._stream()
        self.memory.free(self.transfers.release_all(stream))
        self.transfers.publish(stream)

    # ---- model state_dict -----------------------------------------------------------------------

    def _full_state_dict(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, meta: Any) -> None:
        """Every rank's model state_dict shows the dedicated weights whole (fresh tensors where
        this rank does not keep them; collective), as a plain tensor every rank holds alike."""
        self.wait()
        for b, bucket in enumerate(self.buckets):
            src = bucket.flat if bucket.kept else torch.empty_like(bucket.flat)
            self.transfers.broadcast_bucket(b, to_dlpack(src), self._stream())
            for j in bucket.matrices:
                m = self.matrices[j]
                key = prefix + m.name
                if key in state_dict:
                    state_dict[key] = src[m.offset : m.offset + m.numel].view(m.param.shape).detach()

    def _before_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        self.wait()
        for bucket in self.buckets:
            bucket.materialise()

    def _after_load(self, module: nn.Module, incompatible: Any) -> None:
        for bucket in self.buckets:
            bucket.free()


def dedicate(
    model: nn.Module,
    mesh: Any,
    predicate: Predicate | None = None,
    replicate_mesh: Any = None,
    *,
    planner: str = "milp",
    overlap_step: bool | None = None,
    communicator: str = "auto",
) -> Dedicated:
    """Dedicates the matrices of `model` that `predicate(name, param)` selects (default: those
    distmuon.torch.Muon gives Muon, 2D or convolution kernels) to owner ranks; call it after
    moving the model to its device and dtype, and before ``fully_shard``:

        dm = dedicate(model, mesh)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, ignored_params=dm.ignored_params)
        fully_shard(model, mesh=mesh, ignored_params=dm.ignored_params)
        opt = Muon(model, ...)

    `mesh`: the 1D mesh of FSDP2, or the 2D (replicate, shard) mesh of HSDP; or a 1D shard mesh
    with `replicate_mesh` the 1D replicate mesh. `planner`: 'milp', 'lpt' or 'round-robin'.
    `overlap_step` (default: on CUDA with more than one rank): owners start momentum and orthogonalization of a layer
    as soon as its gradients are in; gradients changed after backward (clipping, unscaling) are
    then not seen, and micro-batches must accumulate under ``no_sync()``. Collective.

    Every rank must call each unit's (layer's) forward through its module (hooks run there) and
    run backward once per synchronised micro-batch. Mixed precision: FSDP2's
    ``MixedPrecisionPolicy`` does not reach these matrices (they are ignored_params), so they keep
    their dtype; run the forward under ``torch.autocast`` (or keep the model in one dtype).

    `communicator` moves the dedicated traffic and serves the optimizer's dedicated engine:
    'auto', 'torch', 'nccl' or 'mpi', as ``Muon(communicator=...)`` (the vote of each step runs
    on a gloo group whatever it is).
    """
    check_communicator(communicator)
    infos = module_param_infos(model)

    def shape(name: str, p: nn.Parameter) -> tuple[int, int, int]:
        info = infos.get(id(p))
        s = matrix_shape(p, info.conv if info else False)
        return (s[-2], s[-1], s[0] if len(s) == 3 else 1)

    if predicate is None:  # Muon's matrices, except stacks of them (FSDP2 keeps those)

        def predicate(name: str, p: nn.Parameter) -> bool:
            return default_muon_filter(name, p, infos.get(id(p))) and shape(name, p)[2] == 1

    for p in model.parameters():
        if handle_of(p) is not None:
            raise ValueError("dedicate(): this model already has dedicated parameters")
        if type(p).__name__ == "DTensor":
            raise ValueError("dedicate() must run before fully_shard (the parameters are DTensors already)")
    grid = make_grid(mesh, replicate_mesh)
    groups = make_groups(grid)
    matrices = collect(model, predicate, shape)
    device = matrices[0].param.device
    info = plan(matrices, grid, groups, device, planner)
    for m, owner in zip(matrices, info["owner"]):
        m.owner = int(owner)
    units, buckets, layout = lay_out(model, matrices, grid)
    if overlap_step is None:
        # One rank has no transfer to hide, and the early solves run layer by layer in smaller
        # batches than step()'s (H200, GPT 12x768: 37.1 ms per step with them, 33.2 without).
        overlap_step = device.type == "cuda" and grid.size > 1
    return Dedicated(model, grid, groups, matrices, units, buckets, layout, info, overlap_step, communicator)

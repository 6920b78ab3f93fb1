"""The engine's optimizer state as torch tensors, in the placement a checkpoint expects.

Where the engine keeps state:
- AdamW ``exp_avg``/``exp_avg_sq`` (and momentum in a single process or in gather mode): shaped
  like what this rank holds of the parameter (the whole of it, or its FSDP2 row shard).
- Muon momentum in the owner modes (replicated, sharded): the whole matrix, on its owner only.

What ``state_dict()`` shows: every state tensor shaped like the parameter — a DTensor with the
parameter's placements for DTensor parameters, a full tensor otherwise — so that
torch.distributed.checkpoint can save it once and load it at another world size. Owner-held
momentum is moved to that placement on export and back to the owners on import
(``_redistribute``, on the engine's communicator). The AdamW state (and any state already in the parameter's placement) is
exported as views of the engine's memory, as torch's optimizers export their live state.

Tensor / expert parallel layouts (``_layout``): a parameter whose boxes are not the engine's rows
("remap") has its momentum moved from the owners to the engine's rows (``_redistribute``) and on
to the boxes of its placement (``_remap``) for a checkpoint, and back the same way on load.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distmuon import _C
from distmuon.torch._dist import Topology, chunk_rows, is_dtensor, local_tensor
from distmuon.torch import _remap
from distmuon.torch._layout import take
from distmuon.torch._redistribute import Block, Move, move_rows
from distmuon.torch._remap import Placed

MOMENTUM = "momentum_buffer"
# State shaped like its parameter (in the parameter's placement in a checkpoint).
PARAM_SHAPED = (MOMENTUM, "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class MatrixState:
    """Per-matrix state kept by each matrix's owner and not shaped like the parameter."""

    shape: Callable[[int, int], tuple[int, ...]]  # (rows, cols) of the matrix -> its shape
    dtype: torch.dtype = torch.float32


# Per-matrix state: an engine state name registered here is saved as one full tensor
# (matrices, *shape) on every rank, which DCP writes once and any world size reads back; on load
# each owner takes its matrices. Such state is optional in a loaded state dict (missing: the
# entries start empty).
MATRIX_STATE: dict[str, MatrixState] = {
    # CacheMuon's entries (distmuon/cache.h, product layout): the m x m transform Q of the wide
    # orientation, saved in float32 whatever the cache dtype (exact for f16/bf16 entries), the
    # reuses since its refresh, the key of the configuration that filled it (0: empty), and the
    # refreshes since its last hit (the check back-off's state).
    "cache_q": MatrixState(lambda r, c: (min(r, c), min(r, c))),
    "cache_age": MatrixState(lambda r, c: ()),
    "cache_key": MatrixState(lambda r, c: (), torch.float64),
    "cache_misses": MatrixState(lambda r, c: ()),
}


@dataclass
class Slot:
    """One parameter as the engine sees it.

    ``full_shape`` is the logical shape of the whole parameter; ``local()`` is the part of it
    this process holds: the whole tensor, or the dim-0 rows ``rows = (begin, count)`` of an
    FSDP2 (DTensor) parameter.
    """

    index: int
    group: int
    name: str
    param: torch.Tensor
    use_muon: bool
    engine_shape: list[int]
    full_shape: torch.Size
    dtype: torch.dtype
    rows: tuple[int, int] | None = None
    key: int = -1  # position in the optimizer's state dict (index is the engine's)
    placed: Placed | None = None  # tensor / expert parallel layouts: how the engine sees it

    def local(self) -> torch.Tensor:
        """What the engine reads and updates: the parameter, its rows, or (layout path) the
        engine's rows of it or its flat box."""
        if self.placed is not None and self.placed.kind == "remap":
            assert self.placed.staging is not None
            return self.placed.staging
        if self.placed is not None and self.placed.kind == "flat":
            return local_tensor(self.param).view(-1)
        return local_tensor(self.param) if self.rows is not None else self.param

    @property
    def local_shape(self) -> torch.Size:
        """The shape of local(): the engine's part of the parameter on this member."""
        if self.rows is None:
            return self.full_shape
        if self.placed is not None and self.placed.kind == "flat":
            return torch.Size([self.rows[1]])
        return torch.Size([self.rows[1] * self.unit, *self.full_shape[1:]])

    @property
    def unit(self) -> int:
        """Rows of the parameter per engine dim-0 index: a block's rows when the engine sees
        row blocks of a matrix as a batch (``row_blocks``), else 1."""
        return self.dim0 // self.engine_shape[0] if len(self.engine_shape) == 3 else 1

    @property
    def held_shape(self) -> torch.Size:
        """The shape of what this process holds of the parameter (and of its gradient)."""
        return torch.Size(self.placed.box_shape) if self.placed is not None else self.local_shape

    def rows_of(self, topo: Topology, member: int) -> tuple[int, int]:
        """(begin, count) of the parameter's dim 0 that `member` registers with the engine."""
        if self.placed is not None:
            begin, count = self.placed.member_rows[member]
            return begin * self.unit, count * self.unit
        if topo.sharded:
            return chunk_rows(self.dim0, topo.shard_size, topo.shard_position(member))
        return 0, self.dim0

    @property
    def dim0(self) -> int:
        return int(self.full_shape[0])

    @property
    def inner(self) -> int:
        return math.prod(self.full_shape[1:])

    def matrices(self) -> list[tuple[int, int]]:
        """Dim-0 rows [lo, hi) of each engine matrix: a 3D batch has one per dim-0 index (a
        block of `unit` rows)."""
        if len(self.engine_shape) == 3:
            u = self.unit
            return [(k * u, (k + 1) * u) for k in range(self.engine_shape[0])]
        return [(0, self.dim0)]


def _view(engine: _C.Engine, s: Slot, name: str) -> torch.Tensor | None:
    a = engine.state(s.index, name)
    return None if a is None else torch.from_dlpack(a)


def owner_held(topo: Topology, s: Slot, name: str) -> bool:
    """True when the engine keeps this state with each matrix's owner (not in place)."""
    return s.use_muon and name == MOMENTUM and topo.mode in ("replicated", "sharded", "dedicated")


def held_momentum(engine: _C.Engine, topo: Topology, s: Slot) -> list[torch.Tensor]:
    """The momentum this process holds of a Muon parameter (views; empty on non-owners)."""
    if not owner_held(topo, s, MOMENTUM):
        v = _view(engine, s, MOMENTUM)
        return [] if v is None else [v]
    out = []
    for k in range(len(s.matrices())):
        a = engine.matrix_state(s.index, k, MOMENTUM)
        if a is not None:
            out.append(torch.from_dlpack(a))
    return out


def _owner_blocks(engine: _C.Engine, s: Slot) -> list[Block]:
    blocks = []
    for k, (lo, hi) in enumerate(s.matrices()):
        a = engine.matrix_state(s.index, k, MOMENTUM)
        t = None if a is None else torch.from_dlpack(a).view(hi - lo, s.inner)
        blocks.append(Block(engine.owner(s.index, k), lo, hi, t))
    return blocks


def _placement_blocks(topo: Topology, s: Slot, mine: torch.Tensor | None) -> list[Block]:
    """Who holds which rows in the parameter's placement; `mine` is this member's part."""
    blocks = []
    for m in range(topo.size):
        lo, n = s.rows_of(topo, m)
        if n > 0:
            t = mine.view(n, s.inner) if (m == topo.member and mine is not None) else None
            blocks.append(Block(m, lo, lo + n, t))
    return blocks


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def _in_placement(s: Slot, local: torch.Tensor) -> torch.Tensor:
    if s.rows is None:
        return local.view(s.full_shape)
    from torch.distributed.tensor import DTensor

    p: Any = s.param
    return DTensor.from_local(
        local.view(s.held_shape), p.device_mesh, p.placements, run_check=False,
        shape=s.full_shape, stride=_contiguous_stride(s.full_shape),
    )


def export_state(
    engine: _C.Engine, topo: Topology, slots: list[Slot], gather_momentum: bool = True, comm: Any = None
) -> list[dict[str, torch.Tensor]]:
    """Per slot: state name -> tensor in the parameter's placement. Collective when the engine
    keeps momentum with owners (every member must call it; moved on the engine's communicator
    `comm`); gather_momentum=False leaves that momentum out (and communicates nothing)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in slots]
    moves: dict[torch.dtype, list[Move]] = {}
    remapped: list[tuple[int, torch.Tensor]] = []  # (slot, momentum in the engine's rows) to move to the boxes
    device = None
    for i, s in enumerate(slots):
        for name in engine.state_names(s.index):
            if name not in PARAM_SHAPED:
                if gather_momentum:
                    mine, move = _matrix_state_move(engine, topo, s, name, export=True)
                    moves.setdefault(MATRIX_STATE[name].dtype, []).append(move)
                    device = s.local().device
                    out[i][name] = mine
                continue
            if owner_held(topo, s, name):
                if not gather_momentum:
                    continue
                blocks = _owner_blocks(engine, s)
                dtype = _momentum_dtype(engine, s)
                device = s.local().device
                mine = torch.empty(s.local_shape, dtype=dtype, device=device)
                moves.setdefault(dtype, []).append(Move(s.name, s.inner, blocks, _placement_blocks(topo, s, mine)))
                if s.placed is not None and s.placed.kind == "remap":
                    remapped.append((i, mine))
                else:
                    out[i][name] = _in_placement(s, mine)
            else:
                v = _view(engine, s, name)
                assert v is not None
                out[i][name] = _in_placement(s, v)
    for dtype, ms in sorted(moves.items(), key=lambda kv: str(kv[0])):
        move_rows(topo, comm, ms, dtype, device)
    if remapped:
        boxes = [torch.empty(slots[i].held_shape, dtype=rows.dtype, device=rows.device) for i, rows in remapped]
        plans = [slots[i].placed.outbound for i, _ in remapped]  # type: ignore[union-attr]
        items = [(plan, rows, box) for plan, (_, rows), box in zip(plans, remapped, boxes)]
        _remap.run_items(topo, comm, items, boxes[0].device)
        for (i, _), box in zip(remapped, boxes):
            out[i][MOMENTUM] = _in_placement(slots[i], box)
    return out


def expected_numel(s: Slot, name: str) -> int:
    """Elements of state `name` of slot `s` in a state dict."""
    if name in PARAM_SHAPED:
        return s.full_shape.numel()
    rows, cols = s.engine_shape[-2:]
    return len(s.matrices()) * math.prod(_matrix_state(s, name).shape(rows, cols))


def _matrix_state(s: Slot, name: str) -> MatrixState:
    if name not in MATRIX_STATE:
        raise NotImplementedError(
            f"the engine keeps state '{name}' for '{s.name}', which distmuon.torch does not know how "
            "to save; register its layout in distmuon.torch._state.MATRIX_STATE"
        )
    return MATRIX_STATE[name]


def _matrix_state_move(
    engine: _C.Engine, topo: Topology, s: Slot, name: str, export: bool, loaded: torch.Tensor | None = None
) -> tuple[torch.Tensor, Move]:
    """Per-matrix state: owners hold matrix k as row k of a (matrices, numel) tensor that every
    member holds whole in a checkpoint. Returns this member's whole tensor and the move."""
    ms = _matrix_state(s, name)
    rows, cols = s.engine_shape[-2:]
    shape = ms.shape(rows, cols)
    n, inner = len(s.matrices()), math.prod(shape)
    owners = []
    for k in range(n):
        a = engine.matrix_state(s.index, k, name)
        t = None if a is None else torch.from_dlpack(a).view(1, inner)
        if topo.mode == "gather":  # every member holds every entry (all decide alike)
            owners += [Block(m, k, k + 1, t if m == topo.member else None) for m in range(topo.size)]
        else:
            owners.append(Block(engine.owner(s.index, k), k, k + 1, t))
    device = s.local().device
    mine = torch.empty((n, *shape), dtype=ms.dtype, device=device) if loaded is None else loaded
    whole = [Block(m, 0, n, mine.view(n, inner) if m == topo.member else None) for m in range(topo.size)]
    return mine, Move(f"{s.name}:{name}", inner, owners, whole) if export else Move(f"{s.name}:{name}", inner, whole, owners)


def _momentum_dtype(engine: _C.Engine, s: Slot) -> torch.dtype:
    """The momentum dtype (its owner's; every member knows it from the group options)."""
    opts = engine.group(s.group).muon
    return torch.bfloat16 if opts.momentum_dtype == _C.DType.bf16 else torch.float32


def local_part(s: Slot, topo: Topology, value: torch.Tensor) -> torch.Tensor:
    """This member's part of a loaded state tensor (DTensor in any placement of the parameter's
    mesh, or a full tensor), shaped like local(); for a remapped parameter, like its box (the
    caller moves it to the engine's rows)."""
    if is_dtensor(value):
        v: Any = value
        if s.rows is None:
            return v.full_tensor().reshape(s.full_shape)
        p: Any = s.param
        if v.device_mesh != p.device_mesh:
            raise ValueError(f"loaded state of '{s.name}' lives on mesh {v.device_mesh}, the parameter on {p.device_mesh}")
        if tuple(v.placements) != tuple(p.placements):
            v = v.redistribute(p.device_mesh, p.placements)
        held = v.to_local().reshape(s.held_shape)
    else:
        full = value.reshape(s.full_shape)
        if s.rows is None:
            return full
        if s.placed is None:
            begin, count = s.rows
            return full[begin : begin + count]
        held = take(full, s.placed.box)
    return held.reshape(-1) if s.placed is not None and s.placed.kind == "flat" else held


def import_state(
    engine: _C.Engine, topo: Topology, slots: list[Slot], entries: list[dict[str, Any] | None], comm: Any = None
) -> None:
    """Loads checked entries (None: fresh state) into the engine. Collective when the engine
    keeps momentum with owners (moved on the engine's communicator `comm`); every member must
    pass entries for the same slots."""
    moves: dict[torch.dtype, list[Move]] = {}
    remapped: list[_remap.Item] = []  # momentum from the boxes to the engine's rows, before the moves
    device = None
    for s, entry in zip(slots, entries):
        for name in engine.state_names(s.index):
            if name not in PARAM_SHAPED:
                if entry is None or name not in entry:  # optional: the entries start empty
                    for k in range(len(s.matrices())):
                        a = engine.matrix_state(s.index, k, name)
                        if a is not None:
                            torch.from_dlpack(a).zero_()
                    continue
                value = entry[name]
                value = value.full_tensor() if is_dtensor(value) else value
                ms = _matrix_state(s, name)
                loaded = value.to(device=s.local().device, dtype=ms.dtype).contiguous()
                _, move = _matrix_state_move(engine, topo, s, name, export=False, loaded=loaded)
                moves.setdefault(ms.dtype, []).append(move)
                device = s.local().device
                continue
            if owner_held(topo, s, name):
                held = held_momentum(engine, topo, s)
                if entry is None:
                    for v in held:
                        v.zero_()
                    continue
                blocks = _owner_blocks(engine, s)
                dtype = _momentum_dtype(engine, s)
                device = s.local().device
                mine = local_part(s, topo, entry[name]).to(device=device, dtype=dtype).contiguous()
                if s.placed is not None and s.placed.kind == "remap":
                    rows = torch.empty(s.local_shape, dtype=dtype, device=device)
                    remapped.append((s.placed.inbound, mine, rows))
                    mine = rows
                moves.setdefault(dtype, []).append(Move(s.name, s.inner, _placement_blocks(topo, s, mine), blocks))
                continue
            v = _view(engine, s, name)
            assert v is not None
            if entry is None:
                v.zero_()
            else:
                v.copy_(local_part(s, topo, entry[name]).reshape(v.shape))
    if remapped:
        _remap.run_items(topo, comm, remapped, remapped[0][2].device)
    for dtype, ms in sorted(moves.items(), key=lambda kv: str(kv[0])):
        move_rows(topo, comm, ms, dtype, device)

"""The engine's optimizer state as torch tensors, in the placement a checkpoint expects.

Where the engine keeps state:
- AdamW ``exp_avg``/``exp_avg_sq`` (and momentum in a single process or in gather mode): shaped
  like what this rank holds of the parameter (the whole of it, or its FSDP2 row shard).
- Muon momentum in the owner modes (replicated, sharded): the whole matrix, on its owner only.

What ``state_dict()`` shows: every state tensor shaped like the parameter — a DTensor with the
parameter's placements for DTensor parameters, a full tensor otherwise — so that
torch.distributed.checkpoint can save it once and load it at another world size. Owner-held
momentum is moved to that placement on export and back to the owners on import
(``_redistribute``). The AdamW state (and any state already in the parameter's placement) is
exported as views of the engine's memory, as torch's optimizers export their live state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distmuon import _C
from distmuon.torch._dist import Topology, chunk_rows, is_dtensor, local_tensor
from distmuon.torch._redistribute import Block, Move, move_rows

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

    def local(self) -> torch.Tensor:
        return local_tensor(self.param) if self.rows is not None else self.param

    @property
    def local_shape(self) -> torch.Size:
        if self.rows is None:
            return self.full_shape
        return torch.Size([self.rows[1], *self.full_shape[1:]])

    @property
    def dim0(self) -> int:
        return int(self.full_shape[0])

    @property
    def inner(self) -> int:
        return math.prod(self.full_shape[1:])

    def matrices(self) -> list[tuple[int, int]]:
        """Dim-0 rows [lo, hi) of each engine matrix: a 3D batch has one per dim-0 index."""
        if len(self.engine_shape) == 3:
            return [(k, k + 1) for k in range(self.engine_shape[0])]
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
        if topo.sharded:
            lo, n = chunk_rows(s.dim0, topo.shard_size, topo.shard_position(m))
        else:
            lo, n = 0, s.dim0
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
        local.view(s.local_shape), p.device_mesh, p.placements, run_check=False,
        shape=s.full_shape, stride=_contiguous_stride(s.full_shape),
    )


def export_state(
    engine: _C.Engine, topo: Topology, slots: list[Slot], gather_momentum: bool = True
) -> list[dict[str, torch.Tensor]]:
    """Per slot: state name -> tensor in the parameter's placement. Collective when the engine
    keeps momentum with owners (every member must call it); gather_momentum=False leaves that
    momentum out (and communicates nothing)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in slots]
    moves: dict[torch.dtype, list[Move]] = {}
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
                out[i][name] = _in_placement(s, mine)
            else:
                v = _view(engine, s, name)
                assert v is not None
                out[i][name] = _in_placement(s, v)
    for dtype, ms in sorted(moves.items(), key=lambda kv: str(kv[0])):
        move_rows(topo, ms, dtype, device)
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
    """This member's rows of a loaded state tensor (DTensor in any placement of the parameter's
    mesh, or a full tensor), shaped like the local part of the parameter."""
    if is_dtensor(value):
        v: Any = value
        if s.rows is None:
            return v.full_tensor().reshape(s.full_shape)
        p: Any = s.param
        if v.device_mesh != p.device_mesh:
            raise ValueError(f"loaded state of '{s.name}' lives on mesh {v.device_mesh}, the parameter on {p.device_mesh}")
        if tuple(v.placements) != tuple(p.placements):
            v = v.redistribute(p.device_mesh, p.placements)
        return v.to_local().reshape(s.local_shape)
    full = value.reshape(s.full_shape)
    if s.rows is None:
        return full
    begin, count = s.rows
    return full[begin : begin + count]


def import_state(engine: _C.Engine, topo: Topology, slots: list[Slot], entries: list[dict[str, Any] | None]) -> None:
    """Loads checked entries (None: fresh state) into the engine. Collective when the engine
    keeps momentum with owners; every member must pass entries for the same slots."""
    moves: dict[torch.dtype, list[Move]] = {}
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
                moves.setdefault(dtype, []).append(Move(s.name, s.inner, _placement_blocks(topo, s, mine), blocks))
                continue
            v = _view(engine, s, name)
            assert v is not None
            if entry is None:
                v.zero_()
            else:
                v.copy_(local_part(s, topo, entry[name]).reshape(v.shape))
    for dtype, ms in sorted(moves.items(), key=lambda kv: str(kv[0])):
        move_rows(topo, ms, dtype, device)

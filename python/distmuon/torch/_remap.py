"""Moving a remapped parameter (``_layout``) between the boxes its placements give the ranks and
the dim-0 rows the engine sees: its weights and gradient in before the step, its new weights
out after it; its momentum either way for checkpoints.

Each direction is a fixed list of transfers per parameter, computed once from every member's
box and rows, so that every member builds the same list and one all-to-all per chunk, on the
engine's communicator, moves everything with no metadata exchange (as ``_redistribute`` does
for rows). A box
held by several members (replicated over ``tp``, or over HSDP replicas) is taken from the
destination itself when it holds it, else from a holder in its replica, the holders taking
turns over destinations.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from typing import Any

import torch

from distmuon.torch._device import comm_stream, to_dlpack
from distmuon.torch._dist import Topology
from distmuon.torch._layout import Holding, boxes, numel
from distmuon.torch._redistribute import all_to_all

# Upper bound of the elements all members send in one all_to_all (bounds the staging memory).
CHUNK_ELEMENTS = 64 << 20


@dataclass(frozen=True)
class Piece:
    """A box of `sizes` at offsets `src` in the sender's tensor and `dst` in the receiver's."""

    sizes: tuple[int, ...]
    src: tuple[int, ...]
    dst: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


@dataclass
class Plan:
    """One direction of one parameter's transfers, as this member takes part in them (every
    member builds the same transfers, so each side's pieces come in the same order)."""

    local: list[Piece] = field(default_factory=list)  # from this member's source to its destination
    sends: dict[int, list[Piece]] = field(default_factory=dict)  # member -> pieces of my source
    recvs: dict[int, list[Piece]] = field(default_factory=dict)  # member -> pieces of my destination
    cross: int = 0  # elements all members send to others: the same on every member

    def add(self, me: int, src: int, dst: int, pieces: list[Piece]) -> None:
        if src != dst:
            self.cross += sum(p.numel for p in pieces)
        if src == me and dst == me:
            self.local += pieces
        elif src == me:
            self.sends.setdefault(dst, []).extend(pieces)
        elif dst == me:
            self.recvs.setdefault(src, []).extend(pieces)


def _overlapping(rows: tuple[tuple[int, int], ...], members: list[int], a: int, b: int) -> list[int]:
    """The members (of one replica, their rows ascending and tiling dim 0) whose rows meet [a, b)."""
    starts = [rows[m][0] for m in members]
    i = max(0, bisect.bisect_right(starts, a) - 1)
    out = []
    for m in members[i:]:
        lo, n = rows[m]
        if lo >= b:
            break
        if n and lo + n > a:
            out.append(m)
    return out


def _replicas_of(topo: Topology, rows: tuple[tuple[int, int], ...]) -> dict[int, list[int]]:
    """Members per replica, in the order of their rows."""
    out: dict[int, list[int]] = {}
    for m in sorted(range(topo.size), key=lambda m: rows[m][0]):
        out.setdefault(topo.replica(m), []).append(m)
    return out


def plan_inbound(topo: Topology, holdings: tuple[Holding, ...], rows: tuple[tuple[int, int], ...]) -> Plan:
    """Transfers that fill every member's engine rows (row `lo` of dim 0 at 0, the other dims
    whole) from the members' boxes."""
    cells: dict[Holding, list[int]] = {}
    for m, h in enumerate(holdings):
        if numel(h):
            cells.setdefault(h, []).append(m)
    replicas = _replicas_of(topo, rows)
    plan = Plan()
    for h, holders in cells.items():
        first, last = h[0][0][0], h[0][-1][1]
        for r, members in replicas.items():
            near = [m for m in holders if topo.replica(m) == r] or holders
            for q in _overlapping(rows, members, first, last):
                lo, n = rows[q]
                pieces = []
                for box, off in boxes(h):
                    a, b = box[0]
                    s, e = max(a, lo), min(b, lo + n)
                    if s < e:
                        sizes = (e - s,) + tuple(y - x for x, y in box[1:])
                        dst = (s - lo,) + tuple(x for x, _ in box[1:])
                        pieces.append(Piece(sizes, (off[0] + s - a,) + off[1:], dst))
                if pieces:
                    plan.add(topo.member, q if q in holders else near[q % len(near)], q, pieces)
    return plan


def plan_outbound(topo: Topology, holdings: tuple[Holding, ...], rows: tuple[tuple[int, int], ...]) -> Plan:
    """Transfers that fill every member's box from the engine rows of its replica's members."""
    replicas = _replicas_of(topo, rows)
    plan = Plan()
    for r, h in enumerate(holdings):
        if not numel(h):
            continue
        by_src: dict[int, list[Piece]] = {}
        for box, off in boxes(h):
            a, b = box[0]
            for q in _overlapping(rows, replicas[topo.replica(r)], a, b):
                lo, n = rows[q]
                s, e = max(a, lo), min(b, lo + n)
                sizes = (e - s,) + tuple(y - x for x, y in box[1:])
                piece = Piece(sizes, (s - lo,) + tuple(x for x, _ in box[1:]), (off[0] + s - a,) + off[1:])
                by_src.setdefault(q, []).append(piece)
        for q, pieces in sorted(by_src.items()):
            plan.add(topo.member, q, r, pieces)
    return plan


def _box(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, s)
    return t


Item = tuple[Plan, torch.Tensor, torch.Tensor]  # (plan, this member's source, destination)


def run(topo: Topology, comm: Any, items: list[Item], dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """Carries out the transfers of `items` (collective over the members, on the engine's
    communicator `comm`; every member passes items of the same plans in the same order). Data
    crosses in `dtype`. Returns the bytes this member sent to and received from others."""
    chunks: list[list[Item]] = [[]]
    load = 0
    for item in items:
        if chunks[-1] and load + item[0].cross > CHUNK_ELEMENTS:
            chunks.append([])
            load = 0
        chunks[-1].append(item)
        load += item[0].cross
    done = [_run_chunk(topo, comm, chunk, dtype, device) for chunk in chunks]
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(a for a, _ in done) * size, sum(b for _, b in done) * size


def _run_chunk(
    topo: Topology, comm: Any, items: list[Item], dtype: torch.dtype, device: torch.device
) -> tuple[int, int]:
    sends: list[list[torch.Tensor]] = [[] for _ in range(topo.size)]
    recvs: list[list[tuple[torch.Tensor, Piece]]] = [[] for _ in range(topo.size)]
    for plan, src, dst in items:
        for p in plan.local:
            _box(dst, p.dst, p.sizes).copy_(_box(src, p.src, p.sizes))
        for q, pieces in plan.sends.items():
            sends[q] += [_box(src, p.src, p.sizes).reshape(-1).to(dtype) for p in pieces]
        for q, pieces in plan.recvs.items():
            recvs[q] += [(dst, p) for p in pieces]
    if not any(plan.cross for plan, _, _ in items):
        return 0, 0  # every member reached the same verdict: no collective
    send_counts = [sum(x.numel() for x in s) for s in sends]
    recv_counts = [sum(p.numel for _, p in r) for r in recvs]
    flat = [x for s in sends for x in s]
    inp = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(recv_counts), dtype=dtype, device=device)
    all_to_all(comm, inp, send_counts, out, recv_counts)
    offset = 0
    for r in recvs:
        for dst, p in r:
            _box(dst, p.dst, p.sizes).copy_(out[offset : offset + p.numel].view(p.sizes))
            offset += p.numel
    return sum(send_counts), sum(recv_counts)


@dataclass
class Placed:
    """How a parameter of the layout path meets the engine (``Slot.placed``).

    - 'native': its boxes are the engine's rows already; registered as it lies.
    - 'remap' (Muon): the engine sees torch.chunk's cut of dim 0 in `staging` and `grad`, filled
      by the `inbound` transfers before each step and copied back by the `outbound` ones.
    - 'flat' (AdamW, elementwise): the engine sees this member's box as a flat run of a 1-D
      tensor; nothing moves.
    """

    kind: str
    member_rows: tuple[tuple[int, int], ...]  # (begin, count) of the engine's dim 0 every member registers
    holdings: tuple[Holding, ...]  # every member's box of the parameter
    member: int
    inbound: Plan
    outbound: Plan
    staging: torch.Tensor | None = None
    grad: torch.Tensor | None = None

    @property
    def box(self) -> Holding:
        return self.holdings[self.member]

    @property
    def box_shape(self) -> tuple[int, ...]:
        return tuple(sum(b - a for a, b in runs) for runs in self.box)

    @property
    def holders(self) -> int:
        """Members holding a non-empty box (the gradient vote's electorate)."""
        return sum(1 for h in self.holdings if numel(h))


def place(topo: Topology, p: Any, use_muon: bool, unit: int = 1) -> Placed:
    """The Placed of DTensor parameter `p` on the layout path's topology. `unit`: rows of `p` per
    engine dim-0 index (the block of ``row_blocks``); member_rows count in those."""
    from distmuon.torch._dist import local_tensor
    from distmuon.torch._layout import chunked_rows, flat_rows, native_rows

    holdings = topo.layouts[id(p)]
    me = topo.member
    if not use_muon:
        return Placed("flat", flat_rows(holdings, topo.shard_size), holdings, me, Plan(), Plan())
    rows = native_rows(holdings, p.shape, topo.shard_size)
    if rows is not None and all(b % unit == 0 and n % unit == 0 for b, n in rows):
        return Placed("native", tuple((b // unit, n // unit) for b, n in rows), holdings, me, Plan(), Plan())
    blocks = chunked_rows(int(p.shape[0]) // unit, topo)
    rows = tuple((b * unit, n * unit) for b, n in blocks)
    local = local_tensor(p)
    staging = torch.empty((rows[me][1], *p.shape[1:]), dtype=p.dtype, device=local.device)
    return Placed(
        "remap", blocks, holdings, me, plan_inbound(topo, holdings, rows), plan_outbound(topo, holdings, rows),
        staging, torch.empty_like(staging),
    )


def run_items(topo: Topology, comm: Any, items: list[Item], device: torch.device) -> tuple[int, int]:
    """run() for items of any dtypes (each crosses in its destination's), one dtype at a time."""
    groups: dict[torch.dtype, list[Item]] = {}
    for item in items:
        groups.setdefault(item[2].dtype, []).append(item)
    done = [run(topo, comm, its, dtype, device) for dtype, its in sorted(groups.items(), key=lambda kv: str(kv[0]))]
    return sum(a for a, _ in done), sum(b for _, b in done)


def inbound(
    topo: Topology, comm: Any, entries: list[tuple[Any, torch.Tensor, torch.Tensor | None]], traffic: list[int]
) -> list[bool]:
    """Before a step: per remapped slot (slot, this member's box of the weights, of the gradient
    or None), whether it steps, and its weights and gradient moved into the engine's rows.
    Collective, on the engine's communicator `comm`. A gradient present on some holders only is
    an error raised on every member before anything moved (as the engine's own vote does). Adds
    the bytes sent and received to `traffic`."""
    if not entries:
        return []
    device = entries[0][1].device
    votes = [int(g is not None and numel(s.placed.box) > 0) for s, _, g in entries]
    tally = torch.tensor(votes, dtype=torch.int64, device=device)
    comm.all_reduce(to_dlpack(tally), stream=comm_stream(device))
    counts = tally.tolist()
    present = []
    for (s, _, _), n in zip(entries, counts):
        if n not in (0, s.placed.holders):
            raise RuntimeError(
                f"parameter '{s.name}' has a gradient on {n} of the {s.placed.holders} ranks holding it; "
                "a parameter steps on every rank or on none (nothing was changed)"
            )
        present.append(n > 0)
    items: list[Item] = []
    for (s, w, g), on in zip(entries, present):
        if on:
            # A member with an empty box has no gradient to send (nor any transfer to send it in).
            items += [(s.placed.inbound, w, s.placed.staging), (s.placed.inbound, w if g is None else g, s.placed.grad)]
    _count(traffic, run_items(topo, comm, items, device))
    return present


def outbound(topo: Topology, comm: Any, entries: list[tuple[Any, torch.Tensor]], traffic: list[int]) -> None:
    """After a step: the new weights from the engine's rows into every holder's box (collective,
    on the engine's communicator `comm`; (slot, this member's box of the weights) of the slots
    that stepped)."""
    if entries:
        items: list[Item] = [(s.placed.outbound, s.placed.staging, w) for s, w in entries]
        _count(traffic, run_items(topo, comm, items, entries[0][1].device))


def _count(traffic: list[int], done: tuple[int, int]) -> None:
    traffic[0] += done[0]
    traffic[1] += done[1]

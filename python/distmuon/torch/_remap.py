"""Moving a remapped parameter (``_layout``) between the boxes its placements give the ranks and
the dim-0 rows the engine sees: its weights and gradient in before the step, its new weights
out after it; its momentum either way for checkpoints.

Each direction is a fixed list of transfers per parameter, computed once from every member's
box and rows, so that every member builds the same list and one ``all_to_all_single`` per
chunk moves everything with no metadata exchange (as ``_redistribute`` does for rows). A box
held by several members (replicated over ``tp``, or over HSDP replicas) is taken from the
destination itself when it holds it, else from a holder in its replica, the holders taking
turns over destinations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distmuon.torch._dist import Topology
from distmuon.torch._layout import Holding, boxes, numel

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


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


def plan_inbound(topo: Topology, holdings: tuple[Holding, ...], rows: tuple[tuple[int, int], ...]) -> list[Transfer]:
    """Transfers that fill every member's engine rows (row `lo` of dim 0 at 0, the other dims
    whole) from the members' boxes."""
    cells: dict[Holding, list[int]] = {}
    for m, h in enumerate(holdings):
        if numel(h):
            cells.setdefault(h, []).append(m)
    out = []
    for q, (lo, n) in enumerate(rows):
        if n == 0:
            continue
        for h, holders in cells.items():
            near = [m for m in holders if topo.replica(m) == topo.replica(q)] or holders
            src = q if q in holders else near[q % len(near)]
            pieces = []
            for box, off in boxes(h):
                a, b = box[0]
                s, e = max(a, lo), min(b, lo + n)
                if s < e:
                    sizes = (e - s,) + tuple(y - x for x, y in box[1:])
                    pieces.append(Piece(sizes, (off[0] + s - a,) + off[1:], (s - lo,) + tuple(x for x, _ in box[1:])))
            if pieces:
                out.append(Transfer(src, q, tuple(pieces)))
    return out


def plan_outbound(topo: Topology, holdings: tuple[Holding, ...], rows: tuple[tuple[int, int], ...]) -> list[Transfer]:
    """Transfers that fill every member's box from the engine rows of its replica's members."""
    out = []
    for r, h in enumerate(holdings):
        if not numel(h):
            continue
        by_src: dict[int, list[Piece]] = {}
        for box, off in boxes(h):
            a, b = box[0]
            for q, (lo, n) in enumerate(rows):
                s, e = max(a, lo), min(b, lo + n)
                if s < e and topo.replica(q) == topo.replica(r):
                    sizes = (e - s,) + tuple(y - x for x, y in box[1:])
                    piece = Piece(sizes, (s - lo,) + tuple(x for x, _ in box[1:]), (off[0] + s - a,) + off[1:])
                    by_src.setdefault(q, []).append(piece)
        out += [Transfer(q, r, tuple(pieces)) for q, pieces in sorted(by_src.items())]
    return out


def _box(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    for d, (o, s) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, s)
    return t


Item = tuple[list[Transfer], torch.Tensor, torch.Tensor]  # (plan, this member's source, destination)


def run(topo: Topology, items: list[Item], dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """Carries out the transfers of `items` (collective over the members; every member passes
    items of the same plans in the same order). Data crosses in `dtype`. Returns the bytes this
    member sent to and received from others."""
    chunks: list[list[Item]] = [[]]
    load = 0
    for item in items:
        cross = sum(t.numel for t in item[0] if t.src != t.dst)
        if chunks[-1] and load + cross > CHUNK_ELEMENTS:
            chunks.append([])
            load = 0
        chunks[-1].append(item)
        load += cross
    done = [_run_chunk(topo, chunk, dtype, device) for chunk in chunks]
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(a for a, _ in done) * size, sum(b for _, b in done) * size


def _run_chunk(topo: Topology, items: list[Item], dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    me = topo.member
    sends: list[list[torch.Tensor]] = [[] for _ in range(topo.size)]
    recvs: list[list[tuple[torch.Tensor, Piece]]] = [[] for _ in range(topo.size)]
    any_cross = False
    for plan, src, dst in items:
        for t in plan:
            any_cross |= t.src != t.dst
            if t.src == me and t.dst == me:
                for p in t.pieces:
                    _box(dst, p.dst, p.sizes).copy_(_box(src, p.src, p.sizes))
            elif t.src == me:
                sends[t.dst] += [_box(src, p.src, p.sizes).reshape(-1).to(dtype) for p in t.pieces]
            elif t.dst == me:
                recvs[t.src] += [(dst, p) for p in t.pieces]
    if not any_cross:
        return 0, 0  # every member reached the same verdict: no collective
    send_counts = [sum(x.numel() for x in s) for s in sends]
    recv_counts = [sum(p.numel for _, p in r) for r in recvs]
    flat = [x for s in sends for x in s]
    inp = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(recv_counts), dtype=dtype, device=device)
    dist.all_to_all_single(out, inp, recv_counts, send_counts, group=topo.group)
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
    inbound: list[Transfer]
    outbound: list[Transfer]
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
        return Placed("flat", flat_rows(holdings, topo.shard_size), holdings, me, [], [])
    rows = native_rows(holdings, p.shape, topo.shard_size)
    if rows is not None and all(b % unit == 0 and n % unit == 0 for b, n in rows):
        return Placed("native", tuple((b // unit, n // unit) for b, n in rows), holdings, me, [], [])
    blocks = chunked_rows(int(p.shape[0]) // unit, topo)
    rows = tuple((b * unit, n * unit) for b, n in blocks)
    local = local_tensor(p)
    staging = torch.empty((rows[me][1], *p.shape[1:]), dtype=p.dtype, device=local.device)
    return Placed(
        "remap", blocks, holdings, me, plan_inbound(topo, holdings, rows), plan_outbound(topo, holdings, rows),
        staging, torch.empty_like(staging),
    )


def run_items(topo: Topology, items: list[Item], device: torch.device) -> tuple[int, int]:
    """run() for items of any dtypes (each crosses in its destination's), one dtype at a time."""
    groups: dict[torch.dtype, list[Item]] = {}
    for item in items:
        groups.setdefault(item[2].dtype, []).append(item)
    done = [run(topo, its, dtype, device) for dtype, its in sorted(groups.items(), key=lambda kv: str(kv[0]))]
    return sum(a for a, _ in done), sum(b for _, b in done)


def inbound(
    topo: Topology, entries: list[tuple[Any, torch.Tensor, torch.Tensor | None]], traffic: list[int]
) -> list[bool]:
    """Before a step: per remapped slot (slot, this member's box of the weights, of the gradient
    or None), whether it steps, and its weights and gradient moved into the engine's rows.
    Collective. A gradient present on some holders only is an error raised on every member
    before anything moved (as the engine's own vote does). Adds the bytes sent and received to
    `traffic`."""
    if not entries:
        return []
    device = entries[0][1].device
    votes = [int(g is not None and numel(s.placed.box) > 0) for s, _, g in entries]
    tally = torch.tensor(votes, dtype=torch.int64, device=device)
    dist.all_reduce(tally, group=topo.group)
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
    _count(traffic, run_items(topo, items, device))
    return present


def outbound(topo: Topology, entries: list[tuple[Any, torch.Tensor]], traffic: list[int]) -> None:
    """After a step: the new weights from the engine's rows into every holder's box (collective;
    (slot, this member's box of the weights) of the slots that stepped)."""
    if entries:
        items: list[Item] = [(s.placed.outbound, s.placed.staging, w) for s, w in entries]
        _count(traffic, run_items(topo, items, entries[0][1].device))


def _count(traffic: list[int], done: tuple[int, int]) -> None:
    traffic[0] += done[0]
    traffic[1] += done[1]

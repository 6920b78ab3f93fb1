"""Moving dim-0 rows of optimizer state between members: from where the engine keeps them (the
owner of each matrix) to where a checkpoint expects them (the parameter's shard, or every rank
for replicated parameters), and back.

Every member builds the same transfer list from the same description (who holds which rows of
which tensor), so one all-to-all per chunk, on the engine's communicator, moves everything, with
no metadata exchange. A row range held by several members (HSDP replicas, replicated parameters) is taken
from the destination itself when it holds it, else from a member of its replica, else from the
lowest-ranked holder.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

import torch

from distmuon.torch._device import comm_stream, to_dlpack
from distmuon.torch._dist import Topology

# Upper bound of the elements one member sends in one all_to_all (bounds the staging memory).
CHUNK_ELEMENTS = 64 << 20


@dataclass
class Block:
    """Rows [lo, hi) of one tensor held (or wanted) by `member`; `tensor` is (hi - lo, inner) on
    this process and None for other members."""

    member: int
    lo: int
    hi: int
    tensor: torch.Tensor | None = None


@dataclass
class Move:
    """One tensor of `inner` elements per dim-0 row: rows go from `sources` to `dests`."""

    name: str
    inner: int
    sources: list[Block]
    dests: list[Block]


@dataclass
class _Transfer:
    src: Block
    dst: Block
    lo: int
    hi: int


def _plan(topo: Topology, move: Move) -> list[_Transfer]:
    out = []
    for d in sorted(move.dests, key=lambda b: (b.member, b.lo)):
        cuts = {d.lo, d.hi}
        for s in move.sources:
            cuts.update(c for c in (s.lo, s.hi) if d.lo < c < d.hi)
        edges = sorted(cuts)
        for a, b in zip(edges, edges[1:]):
            holders = [s for s in move.sources if s.lo <= a and b <= s.hi]
            if not holders:
                raise RuntimeError(f"internal: no rank holds rows [{a}, {b}) of '{move.name}'")
            src = min(
                holders,
                key=lambda s: (s.member != d.member, topo.replica(s.member) != topo.replica(d.member), s.member),
            )
            out.append(_Transfer(src, d, a, b))
    return out


def _rows(block: Block, lo: int, hi: int) -> torch.Tensor:
    assert block.tensor is not None
    return block.tensor[lo - block.lo : hi - block.lo]


def all_to_all(comm: Any, inp: torch.Tensor, send_counts: list[int], out: torch.Tensor, recv_counts: list[int]) -> None:
    """Member q gets inp's run of send_counts[q] elements, and out the runs of recv_counts[q] from
    each member q, packed in member order, on the engine's communicator `comm` (collective over
    the topology's members; complete on return, after the work queued on torch's current
    stream)."""
    if comm is None:
        raise RuntimeError("internal: data crosses members but the engine has no communicator")

    def displs(counts: list[int]) -> list[int]:
        out, at = [], 0
        for c in counts:
            out.append(at)
            at += c
        return out

    comm.all_to_all_v(
        to_dlpack(inp), list(send_counts), displs(send_counts), to_dlpack(out), list(recv_counts),
        displs(recv_counts), stream=comm_stream(out.device),
    )


def move_rows(topo: Topology, comm: Any, moves: list[Move], dtype: torch.dtype, device: torch.device) -> None:
    """Carries out `moves` (collective over the topology's members, on the engine's communicator
    `comm`; identical descriptions on every member). Data crosses in `dtype`."""
    me = topo.member
    plans = [_plan(topo, m) for m in moves]
    # Chunks of moves whose cross-member traffic fits CHUNK_ELEMENTS (decided identically
    # everywhere from the global transfer lists).
    chunks: list[list[int]] = [[]]
    load = 0
    for i, (m, plan) in enumerate(zip(moves, plans)):
        cross = sum((t.hi - t.lo) * m.inner for t in plan if t.src.member != t.dst.member)
        if chunks[-1] and load + cross > CHUNK_ELEMENTS:
            chunks.append([])
            load = 0
        chunks[-1].append(i)
        load += cross
    for chunk in chunks:
        _run_chunk(topo, comm, me, [(moves[i], plans[i]) for i in chunk], dtype, device)


def _run_chunk(
    topo: Topology,
    comm: Any,
    me: int,
    items: list[tuple[Move, list[_Transfer]]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    sends: list[list[torch.Tensor]] = [[] for _ in range(topo.size)]
    recvs: list[list[tuple[Block, int, int, int]]] = [[] for _ in range(topo.size)]  # (dst, lo, hi, n)
    any_cross = False
    for move, plan in items:
        for t in plan:
            cross = t.src.member != t.dst.member
            any_cross |= cross
            if t.src.member == me and t.dst.member == me:
                _rows(t.dst, t.lo, t.hi).copy_(_rows(t.src, t.lo, t.hi).reshape(t.hi - t.lo, -1))
            elif t.src.member == me:
                sends[t.dst.member].append(_rows(t.src, t.lo, t.hi).reshape(-1).to(dtype))
            elif t.dst.member == me:
                recvs[t.src.member].append((t.dst, t.lo, t.hi, (t.hi - t.lo) * move.inner))
    if not any_cross:
        return  # every member reached the same verdict: no collective
    send_counts = [sum(x.numel() for x in s) for s in sends]
    recv_counts = [sum(n for *_, n in r) for r in recvs]
    flat = [x for s in sends for x in s]
    inp = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    out = torch.empty(sum(recv_counts), dtype=dtype, device=device)
    all_to_all(comm, inp.to(device), send_counts, out, recv_counts)
    offset = 0
    for r in recvs:
        for dst, lo, hi, n in r:
            _rows(dst, lo, hi).copy_(out[offset : offset + n].view(hi - lo, -1))
            offset += n

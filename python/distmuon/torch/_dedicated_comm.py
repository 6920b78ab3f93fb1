"""The dedicated runtime's traffic: weights out of the owners in forward, gradients into them in
backward.

Ordering. Ranks must issue the collectives of one process group in the same order. Forward
broadcasts follow the unit order of the forward pass; gradient reductions follow one fixed order
of the matrices (the expected backward order): a matrix is reduced only once every matrix
before it has been, so ranks whose gradients complete in another order still agree. What is
left at step() (matrices without a gradient here, or held back by an earlier one) is reduced
then, after a vote on the control group says which matrices have a gradient anywhere.

Streams. On CUDA the collectives are asynchronous NCCL operations that torch orders after the
current stream when issued; waiting on them makes the current stream (not the host) wait, so a
stage can be issued right after the previous one. On the CPU (gloo) a stage is issued once the
previous one has completed, checked without blocking each time backward delivers a gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distmuon.torch._dedicated_layout import Bucket, Grid, Groups, Matrix, Unit


class Publisher:
    """Forward broadcasts, one per bucket (unit, owner), and in HSDP the publication of updated
    weights to the other replicas after each step."""

    def __init__(self, grid: Grid, groups: Groups, units: list[Unit], buckets: list[Bucket]) -> None:
        self.grid, self.groups, self.units, self.buckets = grid, groups, units, buckets
        self.my_r, self.my_s = grid.coords(grid.member)
        self.work: list[Any] = [None] * len(buckets)  # shard-group broadcast in flight
        self.replica_work: list[Any] = [None] * len(buckets)  # cross-replica publication
        self.issued = [False] * len(buckets)  # in this forward
        self.pending = [0] * len(buckets)  # gradients still to come before the bucket is freed

    def begin_forward(self) -> None:
        self.issued = [False] * len(self.buckets)

    def issue(self, unit: int) -> None:
        """Starts the broadcasts of a unit's buckets (a no-op for those already started)."""
        if not 0 <= unit < len(self.units):
            return
        for b in self.units[unit].buckets:
            if self.issued[b]:
                continue
            self.issued[b] = True
            bucket = self.buckets[b]
            self.pending[b] = len(bucket.matrices)
            self._wait_replica(b)
            bucket.materialise()
            if self.grid.shard > 1:
                owner_s = self.grid.coords(bucket.owner)[1]
                src = self.grid.at(self.my_r, owner_s)
                self.work[b] = dist.broadcast(bucket.flat, src=src, group=self.groups.shard, async_op=True)

    def wait(self, unit: int) -> None:
        """The unit's weights are in place (on CUDA: for work issued on the current stream)."""
        self.issue(unit)
        for b in self.units[unit].buckets:
            if self.work[b] is not None:
                self.work[b].wait()
                self.work[b] = None

    def used(self, bucket: int) -> None:
        """One gradient of the bucket is complete; after the last one its weights may go."""
        self.pending[bucket] -= 1
        if self.pending[bucket] <= 0 and self.work[bucket] is None:
            self.buckets[bucket].free()

    def release_unit(self, unit: int) -> None:
        for b in self.units[unit].buckets:
            if self.work[b] is None:
                self.buckets[b].free()

    def release_all(self) -> None:
        for b, bucket in enumerate(self.buckets):
            if self.work[b] is not None:
                self.work[b].wait()
                self.work[b] = None
            bucket.free()

    def publish(self) -> None:
        """HSDP: each owner sends its updated buckets to the ranks at its shard position in the
        other replicas (asynchronous; waited before the bucket's next broadcast or read)."""
        if self.grid.replicate == 1:
            return
        for b, bucket in enumerate(self.buckets):
            owner_r, owner_s = self.grid.coords(bucket.owner)
            if owner_s != self.my_s:
                continue
            src = self.grid.at(owner_r, owner_s)
            self.replica_work[b] = dist.broadcast(bucket.flat, src=src, group=self.groups.replica, async_op=True)

    def _wait_replica(self, b: int) -> None:
        if self.replica_work[b] is not None:
            self.replica_work[b].wait()
            self.replica_work[b] = None

    def wait_published(self) -> None:
        for b in range(len(self.buckets)):
            self._wait_replica(b)


# Reduction state of a matrix in one step.
NONE, READY, SKIPPED, SENT, LANDED = range(5)


class Reducer:
    """Reduces each matrix's gradient to its owner: inside the shard group to the owner's
    position, then (HSDP) across replicas to the owner. The owner ends with the sum in p.grad
    (finish() or the on_landed callback turns it into the mean); other ranks drop their gradient
    as soon as it is sent.

    ``on_landed(matrices)`` is called on the owner with its matrices of a unit once all of them
    have their reduced gradients (during backward; never while step() collects them). The callee
    must call ``wait(matrices)`` on the stream it will read them from, and returns True when it
    took them (turned their sums into means and prepared their updates)."""

    def __init__(
        self,
        grid: Grid,
        groups: Groups,
        matrices: list[Matrix],
        units: list[Unit],
        cuda: bool,
        on_landed: Callable[[list[int]], bool] | None,
    ) -> None:
        self.grid, self.groups, self.matrices, self.units = grid, groups, matrices, units
        self.cuda = cuda
        self.on_landed = on_landed
        self.my_r, self.my_s = grid.coords(grid.member)
        # Expected completion order in backward: units in reverse, matrices in reverse inside.
        self.order = [j for u in reversed(units) for j in reversed(u.matrices)]
        me = grid.member
        self.mine_per_unit = [sum(1 for j in u.matrices if matrices[j].owner == me) for u in units]
        self.reset()

    def reset(self) -> None:
        n = len(self.matrices)
        self.state = [NONE] * n
        self.work: list[Any] = [None] * n  # the collective in flight (kept until complete)
        # The tensor a collective in flight reads or writes: gloo does not keep it alive, and a
        # non-root's may serve as scratch, so it stays referenced here until the work is done.
        self.buf: list[torch.Tensor | None] = [None] * n
        self.next0 = 0  # position in `order` of the next matrix to send
        self.next1 = 0  # position in `order` of the next sent matrix to move on
        self.arriving: list[int] = []  # owner: final stage issued, not known complete (CPU)
        self.dirty = [False] * n  # a gradient arrived after the matrix was sent
        self.landed_per_unit = [0] * len(self.units)
        self.prepared = [False] * n
        self.collecting = False  # step() is draining: no on_landed calls
        self.late = [False] * n  # a gradient arrived after the matrix's update was prepared

    def _role(self, j: int) -> str:
        m = self.matrices[j]
        if m.owner == self.grid.member:
            return "owner"
        if self.grid.replicate > 1 and self.grid.coords(m.owner)[1] == self.my_s:
            return "relay"
        return "sender"

    # ---- backward ---------------------------------------------------------------------------

    def grad_ready(self, j: int) -> None:
        """Backward completed matrix j's gradient on this rank."""
        if self.state[j] == READY:
            return  # not sent yet: the new gradient accumulated into the same tensor
        if self.state[j] != NONE:
            # Raised at step() on every rank (raising here, on the owner alone, would leave the
            # other ranks waiting in a collective).
            if self.prepared[j]:
                self.late[j] = True
            self.dirty[j] = True
            return
        self.state[j] = READY
        while self.next0 < len(self.order) and self.state[self.order[self.next0]] == READY:
            self._send(self.order[self.next0])
            self.next0 += 1
        self._advance(blocking=False)

    def _send(self, j: int) -> None:
        """Stage 0: the reduction inside the shard group to the owner's shard position."""
        m = self.matrices[j]
        g = m.param.grad
        if g is None:
            g = torch.zeros_like(m.param)
            if m.owner == self.grid.member:
                m.param.grad = g
        self.state[j] = SENT
        role = self._role(j)
        if self.grid.shard > 1:
            dst = self.grid.at(self.my_r, self.grid.coords(m.owner)[1])
            self.work[j] = dist.reduce(g, dst=dst, group=self.groups.shard, async_op=True)
        # (NCCL keeps its tensors safe for the allocator itself: senders let go at once.)
        self.buf[j] = g if (not self.cuda or role != "sender") else None
        if role != "owner":
            m.param.grad = None  # sent: only the collective still needs it

    def _done(self, j: int) -> bool:
        w = self.work[j]
        return w is None or self.cuda or w.is_completed()

    def _advance(self, blocking: bool) -> None:
        """Moves sent matrices on, in the fixed order: stage 1 across replicas (HSDP, at the
        owner's shard position), then arrival on the owner."""
        while self.next1 < self.next0:
            j = self.order[self.next1]
            if self.state[j] == SKIPPED:
                self.next1 += 1
                continue
            if not blocking and not self._done(j):
                break
            role = self._role(j)
            if self.grid.replicate > 1 and role != "sender":
                g = self.matrices[j].param.grad if role == "owner" else self.buf[j]
                assert g is not None
                self.wait([j])  # stage 0 complete (on CUDA: for the current stream)
                self.buf[j] = g  # stage 1's input, kept until it is done
                owner = self.grid.at(*self.grid.coords(self.matrices[j].owner))
                self.work[j] = dist.reduce(g, dst=owner, group=self.groups.replica, async_op=True)
            elif role == "sender" and self._done(j) and not self.cuda:
                self.work[j] = None
                self.buf[j] = None
            if role == "owner":
                self.arriving.append(j)
            self.next1 += 1
        keep = []
        for j in self.arriving:
            if blocking or self._done(j):
                self._arrived(j)
            else:
                keep.append(j)
        self.arriving = keep

    def _arrived(self, j: int) -> None:
        self.state[j] = LANDED
        unit = self.matrices[j].unit
        self.landed_per_unit[unit] += 1
        if self.landed_per_unit[unit] == self.mine_per_unit[unit] and not self.collecting and self.on_landed:
            mine = [k for k in self.units[unit].matrices if self.matrices[k].owner == self.grid.member]
            if self.on_landed(mine):
                for k in mine:
                    self.prepared[k] = True

    def wait(self, js: list[int]) -> None:
        """Matrices' collectives complete (CUDA: for the current stream)."""
        for j in js:
            if self.work[j] is not None:
                self.work[j].wait()
                self.work[j] = None
            if self.matrices[j].owner != self.grid.member:
                self.buf[j] = None

    # ---- step ---------------------------------------------------------------------------------

    def finish(self) -> list[int]:
        """At step(): sends what is left (zeros from ranks without a gradient, nothing for
        matrices without one anywhere, as the vote says), reduces again what gradients arrived
        after it was sent (several synchronised backwards before one step), waits for
        everything and turns the owner's sums into means. Returns the matrices that have a
        gradient in this step."""
        self.collecting = True
        n, size = len(self.matrices), self.grid.size
        if size == 1:
            stepped = [j for j in range(n) if self.matrices[j].param.grad is not None]
            self.reset()
            return stepped
        present = [int(self.state[j] != NONE or self.matrices[j].param.grad is not None) for j in range(n)]
        flags = torch.tensor([present, [int(d) for d in self.dirty], [int(x) for x in self.late]], dtype=torch.int32)
        dist.all_reduce(flags, group=self.groups.control)
        present, again, late = flags[0].tolist(), flags[1].tolist(), flags[2].tolist()
        for pos in range(self.next0, len(self.order)):
            j = self.order[pos]
            if present[j] > 0:
                self._send(j)
            else:
                self.state[j] = SKIPPED
        self.next0 = len(self.order)
        self._advance(blocking=True)
        self.wait(list(range(n)))
        if any(late):
            self.reset()
            name = self.matrices[next(j for j in range(n) if late[j] > 0)].name
            raise RuntimeError(
                f"a second gradient of dedicated matrix '{name}' arrived after its update was prepared "
                "(overlap_step), so this step cannot include it; the step was not applied (the prepared "
                "matrices' momentum has advanced: restore a checkpoint). Accumulate micro-batches under "
                "Dedicated.no_sync() so that only the last backward reduces, or pass overlap_step=False"
            )
        redo = [j for j in self.order if again[j] > 0]
        if redo:
            self._second_pass(redo)
        stepped = [j for j in range(n) if present[j] > 0]
        for j in stepped:
            m = self.matrices[j]
            if m.owner == self.grid.member and not self.prepared[j]:
                assert m.param.grad is not None
                m.param.grad.div_(size)
        self.reset()
        return stepped

    def _second_pass(self, redo: list[int]) -> None:
        saved = self.order
        self.order, self.next0, self.next1, self.arriving = redo, 0, 0, []
        for j in redo:
            self._send(j)
            self.next0 += 1
        self._advance(blocking=True)
        self.wait(redo)
        self.order = saved

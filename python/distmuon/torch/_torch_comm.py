"""The engine's collectives run over a torch.distributed process group (gloo on the CPU).

``distmuon._C.make_python_communicator`` wraps an instance of ``TorchCollectives`` in a C++
Communicator; the engine calls these methods (with the GIL taken for the call only) and gets
back ``None`` (done) or a ``Pending`` it polls or waits on. Every operation is issued with
``async_op=True``, so gloo moves the next bucket while the engine computes the current one. The
operations the engine issues as one group (``Communicator::grouped``: a bucket's broadcasts, a
unit's) come as one ``batch()`` call and complete together (one ``Batch`` to poll or wait on),
as NCCL launches a group: one crossing into Python per group rather than per operation.

Buffers arrive as DLPack arrays over engine memory (``None`` when empty); they stay valid until
the operation completes, and nothing here keeps them longer.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

# distmuon's CommType codes (include/distmuon/comm.h) and ReduceOp codes.
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8)
_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)


class Pending:
    """One operation in flight: the torch Work and what to do once it is complete."""

    __slots__ = ("_work", "_finish", "_keep")

    def __init__(self, work: Any, finish: Callable[[], None] | None = None, keep: object = None) -> None:
        self._work = work
        self._finish = finish
        self._keep = keep  # staging tensors the operation reads or writes

    def test(self) -> bool:
        if not self._work.is_completed():
            return False
        self._complete()
        return True

    def wait(self, timeout_s: float) -> None:
        """Waits at most timeout_s; TimeoutError when the operation is still pending then (the
        engine words the error), the library's error when it failed."""
        try:
            self._work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if not self._work.is_completed():
                raise TimeoutError("timed out") from None
            raise
        self._complete()

    def _complete(self) -> None:
        self._work.wait()  # surfaces an error of a completed operation
        if self._finish is not None:
            self._finish()
            self._finish = None
        self._keep = None


class Batch:
    """The operations of one group, issued in order: complete once all of them are."""

    __slots__ = ("_pending",)

    def __init__(self, pending: list[Pending]) -> None:
        self._pending = pending

    def test(self) -> bool:
        while self._pending:
            if not self._pending[0].test():
                return False
            self._pending.pop(0)
        return True

    def wait(self, timeout_s: float) -> None:
        """Waits for each in turn within one deadline, timeout_s from now (Pending.wait)."""
        deadline = time.monotonic() + timeout_s
        while self._pending:
            self._pending[0].wait(max(deadline - time.monotonic(), 1e-3))
            self._pending.pop(0)


def _tensor(a: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device) if a is None else torch.from_dlpack(a)


def _packed(counts: Sequence[int], displs: Sequence[int]) -> bool:
    offset = 0
    for c, d in zip(counts, displs):
        if c and d != offset:
            return False
        offset += c
    return True


class TorchCollectives:
    """Collectives over `group`, whose group ranks are the communicator's member ranks."""

    def __init__(self, group: Any, device: torch.device, known_groups: Sequence[Any] = ()) -> None:
        self.group = group
        self.device = device
        self.ranks = [int(r) for r in dist.get_process_group_ranks(group)]
        self.known_groups = list(known_groups)  # candidates for split() (HSDP mesh dimensions)

    def _global(self, member: int) -> int:
        return self.ranks[member]

    def _buf(self, a: object, type_code: int) -> torch.Tensor:
        return _tensor(a, _DTYPES[type_code], self.device)

    # ---- collectives (argument order as the C++ side calls them) -------------------------------

    def all_reduce(self, send: object, recv: object, type_code: int, op: int) -> Pending | None:
        if recv is None:
            return None
        s, r = self._buf(send, type_code), self._buf(recv, type_code)
        if s.data_ptr() != r.data_ptr():
            r.copy_(s)
        return Pending(dist.all_reduce(r, op=_OPS[op], group=self.group, async_op=True))

    def reduce(self, send: object, recv: object, type_code: int, op: int, root: int) -> Pending | None:
        if send is None:
            return None
        s = self._buf(send, type_code)
        if recv is not None:  # the root: reduce in place in recv
            t = self._buf(recv, type_code)
            if t.data_ptr() != s.data_ptr():
                t.copy_(s)
        else:
            t = s.clone()  # the library may use a non-root's buffer as scratch; send is read-only
        work = dist.reduce(t, dst=self._global(root), op=_OPS[op], group=self.group, async_op=True)
        return Pending(work, keep=t)

    def broadcast(self, buf: object, type_code: int, root: int) -> Pending | None:
        if buf is None:
            return None
        t = self._buf(buf, type_code)
        return Pending(dist.broadcast(t, src=self._global(root), group=self.group, async_op=True))

    def all_gather_v(
        self, send: object, recv: object, counts: list[int], displs: list[int], type_code: int
    ) -> Pending | None:
        if recv is None:
            return None
        dtype = _DTYPES[type_code]
        s, r = self._buf(send, type_code), self._buf(recv, type_code)
        width = max(counts)
        inp = torch.zeros(width, dtype=dtype, device=self.device)
        inp[: s.numel()].copy_(s)  # also breaks any aliasing of send with its slot of recv
        if all(c == width for c in counts) and _packed(counts, displs):
            out = r[: width * len(counts)]
            return Pending(dist.all_gather_into_tensor(out, inp, group=self.group, async_op=True), keep=inp)
        out = torch.empty(width * len(counts), dtype=dtype, device=self.device)

        def scatter_out() -> None:
            for q, (c, d) in enumerate(zip(counts, displs)):
                if c:
                    r[d : d + c].copy_(out[q * width : q * width + c])

        work = dist.all_gather_into_tensor(out, inp, group=self.group, async_op=True)
        return Pending(work, scatter_out, keep=(inp, out))

    def all_to_all_v(
        self,
        send: object,
        send_counts: list[int],
        send_displs: list[int],
        recv: object,
        recv_counts: list[int],
        recv_displs: list[int],
        type_code: int,
    ) -> Pending | None:
        s, r = self._buf(send, type_code), self._buf(recv, type_code)
        if _packed(send_counts, send_displs):
            inp = s[: sum(send_counts)]
        else:
            inp = torch.cat([s[d : d + c] for c, d in zip(send_counts, send_displs)])
        finish: Callable[[], None] | None = None
        if _packed(recv_counts, recv_displs):
            out = r[: sum(recv_counts)]
        else:
            out = torch.empty(sum(recv_counts), dtype=r.dtype, device=self.device)

            def unpack() -> None:
                offset = 0
                for c, d in zip(recv_counts, recv_displs):
                    r[d : d + c].copy_(out[offset : offset + c])
                    offset += c

            finish = unpack

        work = dist.all_to_all_single(out, inp, list(recv_counts), list(send_counts), group=self.group, async_op=True)
        return Pending(work, finish, keep=(inp, out))

    def barrier(self) -> Pending:
        return Pending(dist.barrier(group=self.group, async_op=True))

    def batch(self, calls: list[tuple[str, tuple[Any, ...]]]) -> Batch | None:
        """The operations (method name, arguments) of one group, issued in order; None when all
        completed during their calls."""
        pending = [p for p in (getattr(self, name)(*args) for name, args in calls) if p is not None]
        return Batch(pending) if pending else None

    def split(self, color: int, key: int) -> tuple[Any, int, int, str, list[int]] | None:
        """The members with this color, ordered by (key, rank), as a new communicator: one of
        the known groups (the HSDP mesh's dimensions) when it has exactly these members in this
        order, else a new torch group."""
        pairs: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(pairs, (color, key), group=self.group)
        if color < 0:
            return None
        members = sorted((q for q, (c, _) in enumerate(pairs) if c == color), key=lambda q: (pairs[q][1], q))
        wanted = [self.ranks[q] for q in members]
        group = next((g for g in self.known_groups if list(dist.get_process_group_ranks(g)) == wanted), None)
        if group is None:
            if wanted != sorted(wanted):
                raise ValueError(f"split: members {wanted} are not in rank order and no existing group matches")
            group = dist.new_group(wanted, use_local_synchronization=True)
        impl = TorchCollectives(group, self.device, self.known_groups)
        me = wanted.index(dist.get_rank())
        return impl, me, len(wanted), f"torch-{dist.get_backend(group)}:split({color})", wanted

"""The engine's backend follows the parameters' device; its communicator follows the topology;
its CUDA work is ordered with torch's streams without host synchronisation."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from distmuon import _C
from distmuon.torch._dist import Topology
from distmuon.torch._torch_comm import TorchCollectives

try:
    from torch.utils.dlpack import to_dlpack as _to_dlpack
except ImportError:  # a torch without the legacy exporter: the tensor's own protocol

    def _to_dlpack(t: torch.Tensor) -> Any:
        return t.detach()


_POLICY = {"skip": _C.NonFinitePolicy.skip, "raise": _C.NonFinitePolicy.raise_}
_MODES = {
    "replicated": _C.DistMode.replicated,
    "sharded": _C.DistMode.sharded,
    "gather": _C.DistMode.gather,
    "dedicated": _C.DistMode.dedicated,
}


def common_device(tensors: Sequence[torch.Tensor], names: Sequence[str]) -> torch.device:
    """The one device every (local part of a) parameter lives on (CPU or one CUDA device)."""
    device = tensors[0].device
    for p, name in zip(tensors, names):
        if p.device != device:
            raise ValueError(
                f"parameters live on several devices ('{names[0]}' on {device}, '{name}' on "
                f"{p.device}); one distmuon.torch.Muon optimizes the parameters of one device"
            )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"distmuon runs on CPU and CUDA tensors, not on {device}")
    if device.type == "cuda" and not _C.cuda_available():
        raise RuntimeError(
            f"parameters are on {device} but this build of distmuon has no CUDA backend "
            "(rebuild with nvcc on the PATH, or keep the model on the CPU)"
        )
    return device


def _cpu_threads() -> None:
    # OpenBLAS's worker threads keep spinning after each product and take the cores from
    # torch's forward/backward that follows (measured on 2 cores: fwd+bwd 179 -> 90 ms and the
    # optimizer step 56 -> 27 ms with one BLAS thread). Inside a torch training loop the
    # CPU backend therefore multiplies on one thread unless DISTMUON_NUM_THREADS says otherwise.
    os.environ.setdefault("DISTMUON_NUM_THREADS", "1")


def gpu_ranks_per_node() -> int:
    """The planner's topology hint on CUDA: ranks on this node, as the launcher says (torchrun's
    LOCAL_WORLD_SIZE, Open MPI's), else one per GPU. Several ranks may share a GPU."""
    for var in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(var, "").isdigit():
            return max(1, int(os.environ[var]))
    return max(1, torch.cuda.device_count())


def _stream(device: torch.device) -> int:
    return int(torch.cuda.current_stream(device).cuda_stream) if device.type == "cuda" else 0


def comm_stream(device: torch.device) -> int:
    """The stream a collective the front runs on an engine's communicator follows (the
    communicator's ``stream`` argument): torch's current stream, whose work made its buffers
    and reads its results (0 on the CPU, where communicators follow no stream)."""
    return _stream(device)


COMMUNICATORS = ("auto", "torch", "nccl", "mpi")


def check_communicator(kind: str) -> None:
    if kind not in COMMUNICATORS:
        raise ValueError(f"communicator must be one of {', '.join(COMMUNICATORS)} (got {kind!r})")


def share_from_first(obj: Any, ranks: tuple[int, ...], group: Any, host_group: Any = None) -> Any:
    """Member 0's `obj` on every member of `ranks` (collective over them).

    Over `host_group` (a gloo group of the same ranks, such as dedicate()'s control group) when
    given: on the host, and without torch building an NCCL communicator for `group` to move a few
    bytes. Else over `group` itself. Never over a gloo group made for the call and destroyed after
    it: a member that let its group go while a peer was still connecting to it refused the
    connection (gloo's connectFullMesh, 4 NCCL ranks on one GPU, 2026-12-06).
    """
    host = host_group if host_group is not None and dist.get_backend(host_group) == "gloo" else group
    box = [obj]
    dist.broadcast_object_list(box, src=ranks[0], group=host)
    return box[0]


def make_communicator(
    topo: Topology, device: torch.device, kind: str = "auto", host_group: Any = None
) -> _C.Communicator:
    """The engine's communicator for `topo`.

    - 'nccl' ('auto' on CUDA when the build has NCCL): the engine's NCCL communicator on torch's
      current stream, its id made by member 0 and shared over `host_group` (a gloo group of the
      same ranks) when given, else over the topology's group.
    - 'torch' ('auto' otherwise): the collectives run over that torch.distributed group (gloo on
      the CPU) through TorchCollectives.
    - 'mpi': the engine's MPI communicator over MPI_COMM_WORLD (CPU; launched by mpirun, with the
      torch ranks equal to the MPI ranks).
    """
    check_communicator(kind)
    if kind == "auto":
        kind = "nccl" if device.type == "cuda" and _C.nccl_available() else "torch"
    if kind == "nccl":
        if device.type != "cuda" or not _C.nccl_available():
            raise ValueError("communicator='nccl' needs CUDA parameters and a build with NCCL")
        uid = share_from_first(_C.nccl_unique_id() if topo.member == 0 else None, topo.ranks, topo.group, host_group)
        with torch.cuda.device(device):
            return _C.make_nccl_communicator(uid, topo.member, topo.size, _stream(device))
    if kind == "mpi":
        if device.type != "cpu" or not _C.mpi_available():
            raise ValueError("communicator='mpi' needs CPU parameters and a build with MPI (DISTMUON_WITH_MPI=ON)")
        comm = _C.make_mpi_world()
        if comm.size != topo.size or list(topo.ranks) != list(range(topo.size)):
            raise ValueError(
                f"communicator='mpi' needs the optimizer's ranks {list(topo.ranks)} to be the MPI world "
                f"(size {comm.size}) in rank order"
            )
        return comm
    impl = TorchCollectives(topo.group, device, topo.mesh_groups)
    name = f"torch-{dist.get_backend(topo.group)}:{topo.mode}"
    index = device.index or 0
    return _C.make_python_communicator(impl, topo.member, topo.size, name, list(topo.ranks), device.type, index)


def make_engine(
    device: torch.device,
    nonfinite: str,
    topo: Topology,
    comm: _C.Communicator | None,
    bucket_mb: float | None,
    dedicated_owners: list[int] | None = None,
    graphs: bool = True,
    autotune: str = "on",
    wire_dtype: str = "",
) -> _C.Engine:
    """The engine for `topo`. The dedicated mode (distmuon.torch.dedicate) takes the owners the
    handle planned and leaves the transfers to it (the engine only computes on the owners).
    `wire_dtype` ('bf16', 'f32', '': the parameters') narrows what the sharded and gather modes
    send (the engine refuses it in the replicated mode; the dedicated runtime moves its own)."""
    if nonfinite not in _POLICY:
        raise ValueError(f"nonfinite must be 'skip' or 'raise' (got {nonfinite!r})")
    if device.type == "cpu":
        _cpu_threads()
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        if comm is None:
            engine = _C.Engine(device.type, _POLICY[nonfinite], graphs, autotune)
            # State is zeroed when parameters are registered: on torch's stream, like the steps.
            if device.type == "cuda":
                engine.set_stream(_stream(device))
            return engine
        opts = _C.DistOptions()
        opts.mode = _MODES[topo.mode]
        opts.replicate = topo.replicate
        if bucket_mb is not None:  # else the engine's default
            opts.bucket_bytes = int(bucket_mb * (1 << 20))
        opts.check_grad_presence = True
        if topo.mode != "dedicated":
            opts.wire_dtype = wire_dtype
        if topo.mode == "dedicated":
            opts.owners = list(dedicated_owners or [])
            opts.caller_transfers = True
        if device.type == "cuda":
            opts.gpus_per_node = gpu_ranks_per_node()
        return _C.Engine(device.type, _POLICY[nonfinite], comm, opts, _stream(device), autotune)


class StreamOrder:
    """Orders the engine's CUDA work with torch's current stream, without host synchronisation;
    on the CPU, runs the engine's work on as many threads as torch's intra-op pool.

    The engine issues on torch's current stream of each step (after an event wait when the
    stream changed since the engine's last work, because its workspace and state were last used
    there); a distributed engine's communicators follow it (the engine binds them to its stream
    whenever it issues work), so there is one stream to follow, the caller's.

    On the CPU the engine's loops take torch.get_num_threads() threads, read before each step:
    with pip's torch both share one OpenMP pool (libgomp, loaded once), but OpenMP's count is
    kept per thread, and a thread that has run no torch operation yet would get one per core;
    and a torch on another OpenMP runtime would keep a second pool of its own.
    """

    def __init__(self, engine: _C.Engine, device: torch.device) -> None:
        self.engine = engine
        self.cuda = device.type == "cuda"
        self.device = device
        self.last = torch.cuda.current_stream(device) if self.cuda else None

    def before(self) -> None:
        """The engine's next work goes to torch's current stream (CUDA), or runs on torch's
        intra-op thread count (CPU)."""
        if self.cuda:
            self.switch(torch.cuda.current_stream(self.device))
        else:
            _C.set_cpu_threads(torch.get_num_threads())

    def switch(self, stream: Any) -> None:
        """The engine's next work goes to `stream`, after the engine's last work (a side stream
        for early work; the next before() brings it back to torch's current stream)."""
        if not self.cuda or stream == self.last:
            return
        stream.wait_stream(self.last)
        self.engine.set_stream(int(stream.cuda_stream))
        self.last = stream


def to_dlpack(t: torch.Tensor) -> Any:
    """A DLPack capsule of `t` (same memory). torch's C-level exporter costs about 0.4 us per
    tensor against about 2.5 us for ``t.__dlpack__()``, which matters at a few hundred tensors
    per step; it also exports parameters that require grad without a detach."""
    return _to_dlpack(t)

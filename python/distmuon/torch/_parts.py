"""The engines of one optimizer. Usually one; two when some matrices are dedicated
(``distmuon.torch.dedicate``): the dedicated matrices step in an engine of the dedicated mode,
everything else in the engine of the detected mode (FSDP2's sharded mode, typically). Every
engine holds every parameter group, so group indices and options are shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from distmuon import _C
from distmuon.torch._device import StreamOrder, make_communicator, make_engine
from distmuon.torch._dist import Topology
from distmuon.torch._options import engine_dtype
from distmuon.torch._state import Slot


@dataclass
class Part:
    """One engine and the parameters it steps (Slot.index is the position in this engine)."""

    engine: _C.Engine
    topo: Topology
    slots: list[Slot]
    order: StreamOrder
    comm: Any = None  # the engine's communicator (None in one process)
    dedicated: Any = None  # the Dedicated handle of a dedicated part
    # Bytes the front sent and received moving remapped parameters (``_remap``) in its steps.
    remap_traffic: list[int] = field(default_factory=lambda: [0, 0])

    def index_of(self, params: list[torch.Tensor]) -> list[Slot]:
        by_id = {id(s.param): s for s in self.slots}
        return [by_id[id(p)] for p in params]


def build_part(
    topo: Topology,
    slots: list[Slot],
    options: list[Any],
    device: torch.device,
    nonfinite: str,
    bucket_mb: float | None,
    communicator: str,
    comm: Any = None,
    dedicated: Any = None,
    graphs: bool = True,
    autotune: str = "on",
    tune: bool = False,
    wire_dtype: str = "",
) -> Part:
    """An engine with every group and these slots, set up (collective when distributed). `comm`
    reuses an existing communicator of the same topology; `tune` measures what the measurement
    store lacks whatever `autotune` says (Engine.tune)."""
    if topo.distributed and comm is None:
        comm = make_communicator(topo, device, communicator)
    owners = dedicated.owner_members([s.param for s in slots]) if dedicated is not None else None
    engine = make_engine(
        device,
        nonfinite,
        topo,
        comm,
        bucket_mb,
        dedicated_owners=owners,
        graphs=graphs,
        autotune=autotune,
        wire_dtype=wire_dtype,
    )
    for o in options:
        engine.add_group(o)
    for s in slots:
        begin, count = s.rows if s.rows is not None else (0, -1)
        engine.add_param(s.name, s.group, s.engine_shape, engine_dtype(s.dtype), begin, count)
    # Distributed: checks the registration on every rank, plans the owners.
    if tune:
        engine.tune()
    else:
        engine.setup()
    return Part(engine, topo, slots, StreamOrder(engine, device), comm, dedicated)


# Counters that add up across engines; the rates are recomputed from them.
_CACHE_WEIGHTED = {
    "residual_mean": "residual_count",
    "update_error_mean": "compared",
    "alignment_mean": "compared",
    "latest_hit_rate": "latest_entries",
    "latest_mean_residual": "latest_with_residual",
    "latest_update_error": "latest_compared",
    "latest_alignment": "latest_compared",
}


def merge_stats(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The engine statistics of two engines of one rank as one."""
    out = {k: (v + b[k] if k not in ("cache", "steps") else v) for k, v in a.items()}
    out["steps"] = max(a["steps"], b["steps"])
    ca, cb = a["cache"], b["cache"]
    c = {}
    for k, v in ca.items():
        if k in _CACHE_WEIGHTED:
            w = _CACHE_WEIGHTED[k]
            n = ca[w] + cb[w]
            c[k] = (v * ca[w] + cb[k] * cb[w]) / n if n else v
        elif k in ("residual_max", "update_error_max"):
            c[k] = max(v, cb[k])
        elif k in ("alignment_min",):
            c[k] = min(v, cb[k]) if ca["compared"] and cb["compared"] else (v if ca["compared"] else cb[k])
        else:
            c[k] = v + cb[k]
    done = c["hits"] + c["refreshes"]
    c["hit_rate"] = c["hits"] / done if done else 0.0
    c["flops_saved_fraction"] = 1.0 - c["flops"] / c["fresh_flops"] if c["fresh_flops"] else 0.0
    if not (cb["latest_compared"] or ca["latest_compared"]):
        c["latest_alignment"] = 1.0
    big = ca if ca["residual_count"] >= cb["residual_count"] else cb  # quantiles do not add up
    c["residual_p50"], c["residual_p90"] = big["residual_p50"], big["residual_p90"]
    out["cache"] = c
    return out

"""The communicator of dedicate() (2 gloo ranks): the engine's C++ transfers run on it and the
optimizer's dedicated engine shares it; an unknown kind is refused before anything collective
runs. The transfers' numbers: test_dedicated.py (against one process) and test_dist_dedicated.cc
(the C++ stages under mpirun)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import dedicated_scenarios as ds
from dist_harness import launch, ok
from distmuon.torch import Muon, dedicate

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")


def shared_communicator(rank: int, world: int) -> dict[str, Any]:
    def run() -> dict[str, Any]:
        model = ds.make_model()
        try:
            dedicate(model, ds.mesh_of("fsdp", world), communicator="gloo")
            refused = ""
        except ValueError as e:
            refused = str(e)
        dm = dedicate(model, ds.mesh_of("fsdp", world), communicator="torch")
        opt = Muon(model, **ds.OPT_KW)
        losses = ds.train(model, opt, range(2), rank, world)
        part = next(p for p in opt._parts if p.dedicated is dm)
        return {"refused": refused, "shared": part.comm is dm.comm, "name": dm.comm.name, "losses": losses}

    return ds.guarded(run)


def test_the_optimizer_shares_the_communicator_of_dedicate() -> None:
    for r in launch(2, shared_communicator):
        res = ok(r)
        assert "communicator must be one of" in res["refused"] and "'gloo'" in res["refused"]
        assert res["shared"] and res["name"].startswith("torch-gloo")
        assert all(math.isfinite(x) for x in res["losses"])  # two steps ran through the shared communicator


def shared_ids(rank: int, world: int) -> dict[str, Any]:
    def run() -> dict[str, Any]:
        import torch.distributed as dist

        from distmuon.torch._device import share_from_first

        ranks = tuple(range(world))
        host = dist.new_group(list(ranks), backend="gloo")
        groups_before = len(dist.distributed_c10d._world.pg_map)
        over_host = share_from_first(b"id-%d" % rank, ranks, None, host)
        over_group = share_from_first({"rank": rank}, ranks, host, None)  # no host group
        return {
            "over_host": over_host,
            "over_group": over_group,
            "groups_left": len(dist.distributed_c10d._world.pg_map) - groups_before,
        }

    return ds.guarded(run)


def test_the_nccl_id_is_shared_on_the_host() -> None:
    # What make_communicator() does with member 0's NCCL id, on gloo ranks: over the given gloo
    # host group, else over the topology's group; no group is made for the call.
    for r in launch(2, shared_ids):
        res = ok(r)
        assert res["over_host"] == b"id-0" and res["over_group"] == {"rank": 0}
        assert res["groups_left"] == 0

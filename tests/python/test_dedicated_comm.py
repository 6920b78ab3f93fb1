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

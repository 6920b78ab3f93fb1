"""Fixtures shared by the pytest suite of the PyTorch front."""

from __future__ import annotations

import os
import tempfile

# torch's OpenMP pool, the engine's OpenMP loops and OpenBLAS's threads share the cores; with
# busy-waiting pools a loaded 2-core CI machine runs the suite 5-10x slower. Must be set before
# torch (and libgomp) load.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# The engine plans on the measurement store of `distmuon-plan --measure` by default: the suite
# (and the ranks it spawns) points the store at a folder nothing creates and leaves the choice
# at its default, so that what a user's ~/.cache or environment holds changes no result.
_NO_STORE = os.path.join(tempfile.gettempdir(), f"distmuon-no-store-{os.getpid()}")
os.environ["DISTMUON_COST_CACHE"] = os.path.join(_NO_STORE, "costs.json")
os.environ.pop("DISTMUON_PLAN_COSTS", None)
# Nor is the store filled at start-up (on CUDA rank 0 would time the shapes it lacks into it).
os.environ["DISTMUON_PLAN_MEASURE"] = "off"

import pytest  # noqa: E402
import torch.optim._muon as torch_muon  # noqa: E402

from helpers import newton_schulz_fp32  # noqa: E402


@pytest.fixture
def torch_muon_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes torch.optim.Muon iterate in float32 for the duration of a test."""
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", newton_schulz_fp32)

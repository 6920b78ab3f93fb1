"""Fixtures shared by the pytest suite of the PyTorch front."""

from __future__ import annotations

import os

# torch's OpenMP pool, the engine's OpenMP loops and OpenBLAS's threads share the cores; with
# busy-waiting pools a loaded 2-core CI machine runs the suite 5-10x slower. Must be set before
# torch (and libgomp) load.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import pytest  # noqa: E402
import torch.optim._muon as torch_muon  # noqa: E402

from helpers import newton_schulz_fp32  # noqa: E402


@pytest.fixture
def torch_muon_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes torch.optim.Muon iterate in float32 for the duration of a test."""
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", newton_schulz_fp32)

"""Fixtures shared by the pytest suite of the PyTorch front."""

from __future__ import annotations

import pytest
import torch.optim._muon as torch_muon

from helpers import newton_schulz_fp32


@pytest.fixture
def torch_muon_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes torch.optim.Muon iterate in float32 for the duration of a test."""
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", newton_schulz_fp32)

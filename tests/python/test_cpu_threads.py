"""The CPU engine beside torch: its loops take torch's intra-op thread count before each step, on
whichever thread steps, with the same bits at any count."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from distmuon import _C
from distmuon.torch import Muon


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Restores torch's intra-op thread count and the engine's after the test."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    _C.set_cpu_threads(0)


def model_and_grads(seed: int) -> tuple[nn.Module, list[torch.Tensor]]:
    # Six matrices of one shape: one batch, which the engine splits over its threads.
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(48, 48, bias=False) for _ in range(6)))
    return model, [torch.randn(48, 48) for _ in range(6)]


def step(opt: Muon, model: nn.Module, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    opt.step()


def test_the_engine_takes_torchs_thread_count_with_the_same_bits(torch_threads: None) -> None:
    weights = []
    for n in (1, 3):
        torch.set_num_threads(n)
        model, grads = model_and_grads(0)
        opt = Muon(model, lr=0.02)
        for _ in range(3):
            step(opt, model, grads)
            assert _C.cpu_threads() == n
        weights.append([p.detach().clone() for p in model.parameters()])
    for one, three in zip(*weights):
        assert torch.equal(one, three)


def in_fresh_thread(f: Callable[[], int]) -> int:
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(f()))
    t.start()
    t.join()
    return out[0]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenMP's own count is torch's on one core")
def test_the_count_holds_on_every_thread(torch_threads: None) -> None:
    # OpenMP keeps its count per thread: one that has run no torch operation has one per core.
    torch.set_num_threads(1)
    model, grads = model_and_grads(1)
    opt = Muon(model, lr=0.02)
    _C.set_cpu_threads(0)
    assert in_fresh_thread(_C.cpu_threads) > 1
    step(opt, model, grads)
    assert in_fresh_thread(_C.cpu_threads) == 1


def test_a_bad_thread_count_is_refused() -> None:
    with pytest.raises(_C.Error, match="not a thread count"):
        _C.set_cpu_threads(-1)

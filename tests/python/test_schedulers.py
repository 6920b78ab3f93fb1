"""LR schedulers drive the engine: param_groups' lr is read every step."""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, OneCycleLR, StepLR

from distmuon.torch import Muon
from helpers import TinyGPT, clone, max_param_diff, muon_and_adamw_params, train

STEPS = 10


def schedulers_for(opt: torch.optim.Optimizer, kind: str) -> object:
    if kind == "lambda":
        return LambdaLR(opt, lambda s: 1.0 / (1 + s))
    if kind == "step":
        return StepLR(opt, step_size=3, gamma=0.3)
    if kind == "cosine":
        return CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-4)
    return OneCycleLR(opt, max_lr=[0.05, 5e-3], total_steps=STEPS)  # one max per group


@pytest.mark.parametrize("kind", ["lambda", "step", "cosine", "onecycle"])
def test_scheduled_run_equals_torch_reference(torch_muon_fp32: None, kind: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    ref = clone(model)
    hidden, rest = muon_and_adamw_params(ref)
    ref_opts = [
        torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1),
        torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01),
    ]
    opt = Muon(model, lr=0.02, weight_decay=0.1, adamw_lr=3e-3, algorithm="ns")
    if kind == "onecycle":
        ref_scheds = [
            OneCycleLR(ref_opts[0], max_lr=0.05, total_steps=STEPS),
            OneCycleLR(ref_opts[1], max_lr=5e-3, total_steps=STEPS),
        ]
    else:
        ref_scheds = [schedulers_for(o, kind) for o in ref_opts]
    sched = schedulers_for(opt, kind)
    train(ref, ref_opts, STEPS, schedulers=ref_scheds)
    train(model, [opt], STEPS, schedulers=[sched])
    assert opt.param_groups[0]["lr"] == pytest.approx(ref_opts[0].param_groups[0]["lr"])
    assert opt.param_groups[1]["lr"] == pytest.approx(ref_opts[1].param_groups[0]["lr"])
    assert max_param_diff(model, ref) < 2e-6


def test_lr_change_takes_effect_and_zero_lr_freezes_weights() -> None:
    model = TinyGPT()
    opt = Muon(model, lr=0.02, weight_decay=0.1)
    train(model, [opt], 1)
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = clone(model)
    train(model, [opt], 2)
    assert max_param_diff(model, before) == 0.0  # lr 0: no update and no decay
    opt.param_groups[0]["lr"] = torch.tensor(0.01)  # tensor lr, as torch allows
    train(model, [opt], 1)
    assert max_param_diff(model, before) > 0.0


def test_invalid_value_set_between_steps_is_caught_before_the_step() -> None:
    model = TinyGPT()
    opt = Muon(model, lr=0.02)
    train(model, [opt], 1)
    opt.param_groups[0]["momentum"] = 1.5
    before = clone(model)
    with pytest.raises(ValueError, match=r"parameter group 0 \(Muon\): momentum must be in \[0, 1\)"):
        train(model, [opt], 1)
    assert max_param_diff(model, before) == 0.0


@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_graphs_option_is_inert_on_the_cpu(graphs: bool) -> None:
    """cuda_graphs is accepted either way; the CPU backend does not capture, so a scheduled run
    counts no graph and equals the other setting bit for bit."""
    torch.manual_seed(2)
    models = [TinyGPT(), None]
    models[1] = clone(models[0])
    opts = [Muon(m, lr=0.02, weight_decay=0.1, adamw_lr=3e-3, cuda_graphs=g)
            for m, g in zip(models, (graphs, not graphs))]
    for m, o in zip(models, opts):
        train(m, [o], steps=4, schedulers=[LambdaLR(o, lambda s: 1.0 / (1 + s))])
    assert max_param_diff(models[0], models[1]) == 0.0
    for o in opts:
        st = o.stats()
        assert st["steps"] == 4 and st["graph_captures"] == 0 and st["graph_replays"] == 0

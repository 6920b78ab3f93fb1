"""Reliability of the PyTorch front (issue: no silent no-op, skipped means unchanged, finite
gradients are finite):

- parameters put into ``param_groups`` after construction (accelerate's FSDP2 preparation swaps
  in the sharded parameters) and groups added with ``add_param_group`` are followed: they are
  re-registered and stepped, parameters that stayed keep their state;
- a Muon matrix skipped for a non-finite gradient keeps everything, its ``step`` included;
- gradients near float32's largest value are stepped as the update rule computes them in
  float64 (their norm, 1e40, used to overflow and make them "non-finite").
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import reliability_scenarios as rs
from dist_harness import launch, max_diff, ok
from distmuon.torch import Muon
from helpers import TinyGPT, clone, gpt_loss, max_param_diff, train

KW: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3}


def state_steps(opt: Muon) -> dict[str, float]:
    names = [n for g in opt.param_groups for n in g["param_names"]]
    return {names[i]: float(st["step"]) for i, st in opt.state_dict()["state"].items()}


# ---- parameters that change after construction -----------------------------------------------


def test_parameters_swapped_into_the_groups_are_stepped() -> None:
    """The single-process form of accelerate's swap: the model's parameters replaced by new
    tensors, and the optimizer's groups pointed at them. The old optimizer stepped the old
    tensors (which have no gradient): the model never changed."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = Muon(model, **KW)
    train(model, [opt], 2)

    def shard(m: nn.Module) -> None:  # new parameter objects with the same values
        for mod in m.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                setattr(mod, name, nn.Parameter(p.detach().clone()))

    twin = clone(model)
    twin_opt = Muon(twin, **KW)  # the documented way: built on the final parameters
    rs.accelerate_swap(model, opt, shard)
    before = clone(model)
    train(model, [opt], 2, first_step=2)
    train(twin, [twin_opt], 2, first_step=2)
    assert max_param_diff(model, before) > 0  # it trains
    assert max_param_diff(model, twin) == 0.0
    # Swapped-in parameters start fresh: their state equals that of an optimizer built on them.
    for n, p in model.named_parameters():
        q = dict(twin.named_parameters())[n]
        for k, v in opt.state[p].items():
            assert torch.equal(v, twin_opt.state[q][k]), (n, k)
    assert all(st == 2.0 for st in state_steps(opt).values())


def test_a_partial_swap_keeps_the_state_of_the_parameters_that_stayed() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = Muon(model, **KW)
    train(model, [opt], 2)
    kept = opt.state[model.qkv.weight]["momentum_buffer"].clone()
    group = next(g for g in opt.param_groups if "fc.weight" in g["param_names"])
    i = group["param_names"].index("fc.weight")
    model.fc.weight = nn.Parameter(model.fc.weight.detach().clone())
    group["params"][i] = model.fc.weight
    train(model, [opt], 1, first_step=2)
    steps = state_steps(opt)
    assert steps["fc.weight"] == 1.0 and steps["qkv.weight"] == 3.0
    assert not torch.equal(opt.state[model.qkv.weight]["momentum_buffer"], kept)  # continued
    assert len(opt.state) == sum(len(g["params"]) for g in opt.param_groups)  # old ones dropped


def test_add_param_group_after_construction_steps_the_new_group() -> None:
    """A group added after some steps is stepped from then on; the others continue. Equal to an
    optimizer that held every group from the start, whose late parameters had no gradient."""
    torch.manual_seed(0)
    model = TinyGPT()
    twin = clone(model)
    late = ("fc.weight", "fc.bias", "out_proj.weight", "out_proj.bias")
    early = [(n, p) for n, p in model.named_parameters() if n not in late]
    opt = Muon(early, **KW)
    train(model, [opt], 1)
    before = clone(model)
    opt.add_param_group({"params": [(n, p) for n, p in model.named_parameters() if n in late]})
    train(model, [opt], 2, first_step=1)
    assert max_param_diff(model.fc, before.fc) > 0

    ref = Muon(list(twin.named_parameters()), **KW)
    twin_late = [p for n, p in twin.named_parameters() if n in late]
    ref.zero_grad()
    gpt_loss(twin, 0).backward()
    for p in twin_late:
        p.grad = None  # not yet in the optimizer at step 0
    ref.step()
    train(twin, [ref], 2, first_step=1)
    assert max_param_diff(model, twin) == 0.0


def test_swapped_parameters_are_checked_like_given_ones() -> None:
    model = TinyGPT()
    opt = Muon(model, **KW)
    opt.param_groups[0]["params"][0] = torch.zeros(3, 3, dtype=torch.int64)
    with pytest.raises(TypeError, match="has dtype torch.int64"):
        opt.step()


def test_fsdp2_swap_after_construction_equals_building_after_sharding() -> None:
    """accelerate's order on 2 gloo ranks: Muon(model) on plain parameters (replicated mode),
    fully_shard, the sharded parameters put into the groups. The optimizer follows them into the
    sharded mode and trains exactly as one built after fully_shard (it used to leave the weights
    unchanged, silently)."""
    for r in launch(2, rs.run_swap):
        res = ok(r)
        assert res["built_as"] == "replicated" and res["mode"] == "sharded"
        assert max_diff(res["params"], res["initial"]) > 0
        assert max_diff(res["params"], res["ref_params"]) == 0.0
        assert res["losses"] == res["ref_losses"]
        for i, st in res["state"].items():
            for k, v in st.items():
                assert torch.equal(v, res["ref_state"][i][k]), (i, k)


# ---- skipped means unchanged -----------------------------------------------------------------


def test_a_skipped_muon_matrix_keeps_its_step_count() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = Muon(model, **KW)
    train(model, [opt], 2)
    opt.zero_grad()
    gpt_loss(model, 2).backward()
    model.fc.weight.grad[1, 2] = float("nan")  # Muon
    model.ln.bias.grad[0] = float("inf")  # AdamW
    model.qkv.weight.grad = None
    opt.step()
    steps = state_steps(opt)
    assert steps["fc.weight"] == 2.0  # was 3: the step counted though nothing changed
    assert steps["ln.bias"] == 2.0 and steps["qkv.weight"] == 2.0
    assert steps["out_proj.weight"] == 3.0
    assert opt.state[model.fc.weight]["step"].item() == 2.0


# ---- finite is finite -----------------------------------------------------------------------


def ns5_float64(u: torch.Tensor, eps: float) -> torch.Tensor:
    """torch.optim.Muon's iteration with distmuon's normalisation (U / (||U|| + eps)), in
    float64."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = u.to(torch.float64)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(16, 48), (48, 16)])
def test_gradients_near_float_max_follow_the_float64_update_rule(shape: tuple[int, int]) -> None:
    """Entries up to 3e38: finite, but the Nesterov input reaches 1.95 x that and the norm
    ~1e40. Every step is taken and matches the rule computed in float64."""
    torch.manual_seed(0)
    lr, wd, mu, eps = 0.02, 0.1, 0.95, 1e-7
    w = nn.Parameter(torch.randn(shape) * 0.02)
    opt = Muon([("layer.w", w)], lr=lr, weight_decay=wd, momentum=mu, eps=eps)
    w_ref = w.detach().to(torch.float64)
    buf = torch.zeros(shape, dtype=torch.float64)
    scale = math.sqrt(max(1.0, shape[0] / shape[1]))
    for step, peak in enumerate((3e38, 1e37, 1e37)):
        g = torch.randn(shape)
        w.grad = (g / g.abs().max() * peak).to(torch.float32)
        opt.step()
        g64 = w.grad.to(torch.float64)
        buf = mu * buf + g64
        o = ns5_float64(g64 + mu * buf, eps)
        w_ref = w_ref * (1 - lr * wd) - lr * scale * o
        err = (w.detach().to(torch.float64) - w_ref).norm() / w_ref.norm()
        assert err < 1e-5, (step, err.item())
    assert opt.stats()["nonfinite_skips"] == 0
    assert float(opt.state_dict()["state"][0]["step"]) == 3.0


def test_a_momentum_beyond_float32_is_a_skip_that_changes_nothing() -> None:
    """The sum-form momentum B = mu B + G of a gradient repeated at 3e38 would be 5.9e38: not a
    float32. The step is skipped (raise policy: refused) and nothing changes."""
    w = nn.Parameter(torch.randn(8, 24) * 0.02)
    opt = Muon([("w", w)], lr=0.02)
    g = torch.randn(8, 24)
    w.grad = g / g.abs().max() * 3e38
    opt.step()
    before, mom = w.detach().clone(), opt.state[w]["momentum_buffer"].clone()
    opt.step()
    assert torch.equal(w, before) and torch.equal(opt.state[w]["momentum_buffer"], mom)
    assert opt.stats()["nonfinite_skips"] == 1
    strict = Muon([("w", w)], lr=0.02, nonfinite="raise")
    strict.step()
    with pytest.raises(RuntimeError, match="momentum beyond the range of its dtype, in 'w'"):
        strict.step()

"""``algorithm='auto'`` per shape class: the ``autotune`` option and ``Muon.tune()``. On the CPU
the backend is not tuned (every answer is the heuristic); on a CUDA device tune() measures what
the measurement store lacks, a later optimizer finds it stored, and a new shape is predicted by
the cost model calibrated on the stored ones."""

from __future__ import annotations

import pytest
import torch

import distmuon
from distmuon.torch import Muon
from helpers import TinyGPT, clone, max_param_diff, train


def test_autotune_option_is_checked() -> None:
    with pytest.raises(ValueError, match="autotune must be 'on', 'cached' or 'off'"):
        Muon(TinyGPT(), autotune="sometimes")


@pytest.mark.parametrize("autotune", ["on", "off"])
def test_tune_on_the_cpu_answers_the_heuristic_per_class(autotune: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    ref = clone(model)
    o = Muon(model, lr=0.02, autotune=autotune)
    built = o.tuned_shapes()  # resolved when the optimizer built its engine
    rows = o.tune()
    assert rows == built
    # TinyGPT's Muon matrices: qkv 48 x 16 and proj 16 x 48, fc 64 x 16 and out_proj 16 x 64.
    assert sorted((r["rows"], r["cols"], r["count"]) for r in rows) == [(16, 48, 2), (16, 64, 2)]
    for r in rows:
        assert r["source"] == "heuristic" and r["ms"] == 0.0 and r["group"] == 0
        assert r["algorithm"] == "gram-ns"  # aspect >= 1.5: the heuristic's Gram NS
    assert o.tuned_shapes() == rows
    assert o.tune() == rows  # again: nothing changes
    # tune() rebuilds the engine with its state: before and during training on the CPU, the same
    # run as without it, bit for bit.
    ref_opt = Muon(ref, lr=0.02, autotune=autotune)
    train(model, [o], steps=3)
    train(ref, [ref_opt], steps=3)
    assert o.tune() == rows
    train(model, [o], steps=3, first_step=3)
    train(ref, [ref_opt], steps=3, first_step=3)
    assert max_param_diff(model, ref) == 0.0
    # tune() takes the groups' current options: an explicit algorithm is not the tuner's.
    for g in o.param_groups:
        g["algorithm"] = "ns5"
    assert o.tune() == []
    for g in o.param_groups:
        g["algorithm"] = "auto"
    assert o.tune() == rows


@pytest.mark.skipif(not torch.cuda.is_available() or not distmuon.cuda_available(), reason="needs CUDA")
def test_tune_measures_stores_and_predicts_on_cuda(tmp_path, monkeypatch, capfd) -> None:
    monkeypatch.setenv("DISTMUON_COST_CACHE", str(tmp_path / "costs.json"))
    monkeypatch.delenv("DISTMUON_AUTOTUNE", raising=False)

    def model(dim: int) -> torch.nn.Module:
        torch.manual_seed(0)
        return TinyGPT(dim=dim).cuda()

    # Classes this small share their launches on CUDA (grouped products), and `auto` gives them
    # Gram NS untimed: the same schedule for all, so that they share every launch.
    assert {r["source"] for r in Muon(model(64), autotune="cached").tuned_shapes()} == {"grouped"}
    # The tuner, timing and storing each class alone, is what the rest is about.
    monkeypatch.setenv("DISTMUON_GROUPED_PRODUCTS", "off")
    o = Muon(model(64), lr=0.02, autotune="cached")
    assert {r["source"] for r in o.tuned_shapes()} == {"heuristic"}  # an empty store
    rows = o.tune()
    assert {r["source"] for r in rows} == {"measured"}
    assert all(r["ms"] > 0 and r["algorithm"] in ("ns5", "ns5-sym", "gram-ns") for r in rows)
    err = capfd.readouterr().err
    assert "[tune 1/2]" in err and "[tune 2/2]" in err  # progress, one line per class
    assert {r["source"] for r in o.tune()} == {"stored"}
    # Another optimizer on the same shapes finds them stored; new shapes are predicted.
    assert {r["source"] for r in Muon(model(64), autotune="cached").tune()} == {"stored"}
    m = model(96)
    p = Muon(m, lr=0.02, autotune="cached")
    train(m, [p], steps=2, loss_fn=lambda mod, s: mod(torch.randint(0, 23, (4, 8), device="cuda")).square().mean())
    assert {r["source"] for r in p.tuned_shapes()} == {"predicted"}
    assert torch.isfinite(torch.cat([q.detach().flatten() for q in m.parameters()])).all()

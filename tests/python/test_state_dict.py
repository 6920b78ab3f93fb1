"""state_dict() / load_state_dict(): torch's format, exact round trips, refusal of bad dicts."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch.optim.lr_scheduler import OneCycleLR

from distmuon.torch import Muon
from helpers import TinyGPT, clone, max_param_diff, muon_and_adamw_params, train


def make(model: torch.nn.Module, **kw: object) -> Muon:
    return Muon(model, lr=0.02, weight_decay=0.1, adamw_lr=3e-3, **kw)  # type: ignore[arg-type]


def test_state_dict_hooks_see_and_may_replace_the_whole_dict() -> None:
    # As in torch: a post-hook gets the complete dict (the engine's state included) and what it
    # returns is the result; a load pre-hook runs before the dict is checked. Before, the engine's
    # state was written over a post-hook's edits, and a wrapped dict raised KeyError('state').
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 2)

    def to_bf16(o: object, sd: dict) -> None:
        for st in sd["state"].values():
            for k, v in st.items():
                if k != "step":
                    st[k] = v.to(torch.bfloat16)

    handle = opt.register_state_dict_post_hook(to_bf16)
    assert opt.state_dict()["state"][0]["momentum_buffer"].dtype == torch.bfloat16
    handle.remove()
    handle = opt.register_state_dict_post_hook(lambda o, sd: {"format": 1, "payload": sd})
    wrapped = opt.state_dict()
    handle.remove()
    assert wrapped["format"] == 1 and set(wrapped["payload"]) == {"state", "param_groups"}
    opt.register_load_state_dict_pre_hook(lambda o, sd: sd["payload"] if "payload" in sd else None)
    other = make(clone(model))
    other.register_load_state_dict_pre_hook(lambda o, sd: sd["payload"] if "payload" in sd else None)
    other.load_state_dict(wrapped)
    expected = opt.state_dict()
    for i, st in other.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, expected["state"][i][k]), (i, k)


def test_format_is_torch_optimizer_format() -> None:
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 3)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    flat = [p for g in opt.param_groups for p in g["params"]]
    assert sorted(sd["state"]) == list(range(len(flat)))
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1, 2, 3], list(range(4, len(flat)))]
    for i, p in enumerate(flat):
        st = sd["state"][i]
        if i < 4:
            assert set(st) == {"step", "momentum_buffer"}
            assert st["momentum_buffer"].shape == p.shape and st["momentum_buffer"].dtype == torch.float32
        else:
            assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
            assert st["exp_avg"].shape == p.shape
        assert st["step"].item() == 3.0 and st["step"].dtype == torch.float32
    # the AdamW state is torch.optim.AdamW's: first moment of the last gradients
    assert sd["state"][4]["exp_avg"].abs().sum() > 0


def test_round_trip_through_torch_save_continues_identically() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 5)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)

    train(model, [opt], 5, first_step=5)  # the uninterrupted run

    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = TinyGPT()
    resumed.load_state_dict(ckpt["model"])
    opt2 = make(resumed)
    opt2.load_state_dict(ckpt["optim"])
    train(resumed, [opt2], 5, first_step=5)
    assert max_param_diff(model, resumed) == 0.0  # bit-identical continuation


def test_round_trip_with_momentum_schedule_and_loaded_group_options() -> None:
    """Group options come back from the dict (as in torch), including a cycled momentum."""
    torch.manual_seed(1)
    model = TinyGPT()
    opt = make(model)
    sched = OneCycleLR(opt, max_lr=[0.05, 5e-3], total_steps=12)
    train(model, [opt], 6, schedulers=[sched])
    snap = (copy.deepcopy(opt.state_dict()), sched.state_dict(), clone(model))
    train(model, [opt], 6, first_step=6, schedulers=[sched])

    osd, ssd, m2 = snap
    opt2 = make(m2)
    sched2 = OneCycleLR(opt2, max_lr=[0.05, 5e-3], total_steps=12)
    sched2.load_state_dict(ssd)
    opt2.load_state_dict(osd)
    assert opt2.param_groups[0]["momentum"] == osd["param_groups"][0]["momentum"] != 0.95
    train(m2, [opt2], 6, first_step=6, schedulers=[sched2])
    assert max_param_diff(model, m2) == 0.0


def test_loading_into_a_fresh_optimizer_before_any_step() -> None:
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 2)
    sd = copy.deepcopy(opt.state_dict())
    opt2 = make(clone(model))
    opt2.load_state_dict(sd)
    for p, q in zip(
        (p for g in opt.param_groups for p in g["params"]), (p for g in opt2.param_groups for p in g["params"])
    ):
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][k]), k


def test_missing_entries_mean_fresh_state() -> None:
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 2)
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][0]
    opt.load_state_dict(sd)
    assert opt.state[model.qkv.weight]["momentum_buffer"].abs().sum() == 0
    assert opt.state_dict()["state"][0]["step"] == 0


def snapshot(opt: Muon) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda sd: sd["param_groups"].pop(), "2 parameter groups|1 parameter groups"),
        (lambda sd: sd["param_groups"][0]["params"].pop(), "group 0 has 4 parameters, the loaded one 3"),
        (lambda sd: sd["param_groups"][0].update(use_muon=False), "group 0 is Muon here"),
        (lambda sd: sd["state"][5].pop("exp_avg_sq"), "has no tensor 'exp_avg_sq'"),
        (lambda sd: sd["state"][6].update(exp_avg=torch.zeros(3)), r"'exp_avg' .* has shape \(3,\)"),
        (lambda sd: sd["state"][1].update(step=torch.tensor(-1.0)), "loaded step"),
        (lambda sd: sd["param_groups"][1].update(betas=(0.9, 1.5)), r"betas must be in \[0, 1\)"),
        (lambda sd: sd["param_groups"][1].update(maximize=True), "maximize=True, which distmuon does not"),
    ],
)
def test_bad_state_dicts_change_nothing(corrupt: object, match: str) -> None:
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 2)
    sd = copy.deepcopy(opt.state_dict())
    # make the valid parts differ from the live state, so a partial load would show
    for st in sd["state"].values():
        for k, v in st.items():
            if k != "step":
                v.add_(1.0)
    corrupt(sd)  # type: ignore[operator]
    before = snapshot(opt)
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = snapshot(opt)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups_before


def test_bf16_momentum_round_trip() -> None:
    model = TinyGPT()
    opt = make(model, momentum_dtype=torch.bfloat16)
    train(model, [opt], 2)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"][0]["momentum_buffer"].dtype == torch.bfloat16
    opt2 = make(clone(model), momentum_dtype=torch.bfloat16)
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"], sd["state"][0]["momentum_buffer"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_distributed_checkpoint_round_trip_in_one_process(tmp_path: object) -> None:
    """torch.distributed.checkpoint (FQN-keyed optimizer state) saves and restores exactly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    torch.manual_seed(2)
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 3)
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    assert "qkv.weight" in sd["optim"]["state"]
    dcp.save(sd, checkpoint_id=str(tmp_path))
    train(model, [opt], 3, first_step=3)

    model2 = TinyGPT()
    opt2 = make(model2)
    sd2 = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(sd2, checkpoint_id=str(tmp_path))
    set_model_state_dict(model2, sd2["model"])
    set_optimizer_state_dict(model2, opt2, sd2["optim"])
    train(model2, [opt2], 3, first_step=3)
    assert max_param_diff(model, model2) == 0.0


def test_per_matrix_state_hook_round_trips(monkeypatch: pytest.MonkeyPatch) -> None:
    """State kept per matrix by its owner and not shaped like the parameter (CacheMuon's Gram
    transform, branch `cache`) is saved through the MATRIX_STATE hook as one (matrices, *shape)
    tensor and loaded back into each matrix's slot."""
    from distmuon.torch import _state
    from distmuon.torch._dist import Topology

    monkeypatch.setitem(_state.MATRIX_STATE, "cache_q", _state.MatrixState(lambda r, c: (min(r, c), min(r, c))))

    class FakeEngine:  # the engine methods export/import use, with one extra per-matrix state
        def __init__(self) -> None:
            self.q = [torch.randn(4, 4) for _ in range(2)]
            self.m = torch.zeros(2, 4, 6)

        def state_names(self, i: int) -> list[str]:
            return ["momentum_buffer", "cache_q"]

        def state(self, i: int, name: str) -> torch.Tensor:
            return self.m

        def matrix_state(self, i: int, k: int, name: str) -> torch.Tensor:
            return self.q[k]

        def owner(self, i: int, k: int) -> int:
            return 0

    p = torch.nn.Parameter(torch.zeros(2, 4, 6))
    slot = _state.Slot(0, 0, "experts", p, True, [2, 4, 6], p.shape, p.dtype)
    src, dst = FakeEngine(), FakeEngine()
    topo = Topology("local")
    saved = _state.export_state(src, topo, [slot])[0]  # type: ignore[arg-type]
    assert saved["cache_q"].shape == (2, 4, 4)
    assert _state.expected_numel(slot, "cache_q") == 32
    _state.import_state(dst, topo, [slot], [saved])  # type: ignore[arg-type]
    for k in range(2):
        assert torch.equal(dst.q[k], src.q[k])
    with pytest.raises(NotImplementedError, match="MATRIX_STATE"):
        monkeypatch.delitem(_state.MATRIX_STATE, "cache_q")
        _state.export_state(src, topo, [slot])  # type: ignore[arg-type]


def test_a_torch_muon_state_dict_continues_as_torch_would(torch_muon_fp32: None) -> None:
    """torch.optim.Muon keeps its momentum as an average ((1 - mu) times this optimizer's sum): its
    state dict is converted on load, so the run continues as torch's own would. (The other
    parameters are frozen: the comparison is of the Muon part alone.)"""
    torch.manual_seed(0)
    ref = TinyGPT()
    hidden, rest = muon_and_adamw_params(ref)
    for p in rest:
        p.requires_grad_(False)
    kw = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.9}
    t_muon = torch.optim.Muon(hidden, **kw)  # type: ignore[arg-type]
    train(ref, [t_muon], 3)
    resumed = clone(ref)
    r_hidden, _ = muon_and_adamw_params(resumed)
    d_muon = Muon([{"params": r_hidden, "use_muon": True}], algorithm="gram-ns", **kw)  # type: ignore[arg-type]
    d_muon.load_state_dict(t_muon.state_dict())
    train(ref, [t_muon], 3, first_step=3)
    train(resumed, [d_muon], 3, first_step=3)
    assert max_param_diff(ref, resumed) < 2e-6
    for p, q in zip(hidden, r_hidden):  # the buffers: torch's average over (1 - mu)
        assert torch.allclose(t_muon.state[p]["momentum_buffer"] / 0.1, d_muon.state[q]["momentum_buffer"], atol=1e-6)

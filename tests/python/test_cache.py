"""CacheMuon in the PyTorch front: options, stats(), and its entries in state_dict (single
process here; distributed and cross-world-size round trips are in test_distributed.py)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from distmuon.torch import Muon
from helpers import TinyGPT, clone, gpt_loss, max_param_diff, train

KW = {"lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3}
# TinyGPT's Muon matrices: qkv 48x16, proj 16x48, fc 64x16, out_proj 16x64. All elongated, so
# 'auto' orthogonalizes them with Gram NS and every one has a cache entry.
CACHED = 4


def make(model: torch.nn.Module, **kw: object) -> Muon:
    return Muon(model, **KW, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"cache_gamma": -1.0}, "cache_gamma must be a positive number"),
        ({"cache_gamma": True}, "cache_gamma must be a positive number"),
        ({"cache_gamma": 2.0, "cache_probes": 0}, "cache_probes must be None"),
        ({"cache_gamma": 2.0, "cache_max_staleness": -2}, "cache_max_staleness must be an integer"),
        ({"cache_gamma": 2.0, "cache_check_backoff": -1}, "cache_check_backoff must be an integer"),
        ({"cache_gamma": 2.0, "cache_check_backoff": 2.5}, "cache_check_backoff must be an integer"),
        ({"cache_gamma": 2.0, "cache_gate": "all"}, "cache_gate must be 'matrix' or 'batch'"),
        ({"cache_gate": None}, "cache_gate must be 'matrix' or 'batch'"),
    ],
)
def test_bad_cache_options_are_refused_naming_the_group(bad: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        make(TinyGPT(), **bad)
    assert "parameter group 0 (Muon)" in str(e.value)


def test_bad_cache_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported dtype torch.int32"):
        make(TinyGPT(), cache_gamma=2.0, cache_dtype=torch.int32)


def test_cache_off_by_default_and_stats_without_it() -> None:
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 2)
    st = opt.stats()
    assert st["steps"] == 2 and st["ortho_flops"] > 0 and st["nonfinite_skips"] == 0
    assert st["cache_hits"] == st["cache_refreshes"] == 0
    assert "last_update_rel_err" not in st
    assert set(opt.state_dict()["state"][0]) == {"step", "momentum_buffer"}


@pytest.mark.parametrize("backoff, untested_steps", [(0, 0), (4, 1)])
def test_tiny_gamma_never_reuses_and_equals_plain_muon(backoff: int, untested_steps: int) -> None:
    """Every test fails: every step refreshes, as plain Muon. With the check back-off, step 5
    (three misses in a row before it) refreshes without a test."""
    torch.manual_seed(0)
    a = TinyGPT()
    b = clone(a)
    opt_a, opt_b = make(a), make(b, cache_gamma=1e-9, cache_check_backoff=backoff)
    la, lb = train(a, [opt_a], 6), train(b, [opt_b], 6)
    assert la == lb and max_param_diff(a, b) == 0.0
    st = opt_b.stats()
    assert st["cache_hits"] == 0 and st["cache_refreshes"] == 6 * CACHED
    assert st["cache_unchecked_refreshes"] == untested_steps * CACHED
    assert st["last_hit_rate"] == 0.0 and st["last_mean_residual"] > 1e-9


def test_stats_count_hits_and_the_last_step() -> None:
    """A gamma above every residual reuses each transform from the second step on, except the
    forced refresh every cache_max_staleness + 1 steps."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = make(model, cache_gamma=1e6, cache_max_staleness=2, cache_shadow=True)
    seen = []
    for step in range(7):
        train(model, [opt], 1, first_step=step)
        seen.append(opt.stats())
    # refresh at steps 0, 3, 6; hits at 1, 2, 4, 5
    assert [s["last_hit_rate"] for s in seen] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    last = seen[-1]
    assert last["cache_hits"] == 4 * CACHED and last["cache_refreshes"] == 3 * CACHED
    assert last["cache_hit_rate"] == pytest.approx(4 / 7)
    assert last["cache_flops_saved"] > 0  # hits cost less than fresh solves
    assert seen[1]["ortho_flops"] - seen[0]["ortho_flops"] < seen[0]["ortho_flops"]
    # shadow: accepted updates measured against the fresh ones (with this gamma, far from them)
    for s in (seen[1], seen[2], seen[4], seen[5]):
        assert s["last_update_rel_err"] > 0 and -1 <= s["last_alignment"] < 1
    assert seen[3]["last_update_rel_err"] == 0.0 and seen[3]["last_alignment"] == 1.0  # all refreshed
    assert all(s["last_mean_residual"] > 0 for s in seen[1:])


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16])
def test_cache_entries_round_trip_through_state_dict(dtype: torch.dtype | None) -> None:
    """Saved entries (Q, age, key) restore exactly: the resumed run keeps reusing the same
    transforms and continues bit-identically, hits included."""
    torch.manual_seed(0)
    model = TinyGPT()
    kw = {"cache_gamma": 1e6, "cache_max_staleness": 4, "cache_dtype": dtype}
    opt = make(model, **kw)
    train(model, [opt], 5)
    sd = opt.state_dict()
    entry = sd["state"][0]
    assert set(entry) == {"step", "momentum_buffer", "cache_q", "cache_age", "cache_key", "cache_misses"}
    assert entry["cache_q"].shape == (1, 16, 16) and entry["cache_q"].dtype == torch.float32
    # refresh at step 0, reused at 1..4: age 4 (the next step must refresh)
    assert entry["cache_age"].tolist() == [4.0] and entry["cache_key"].dtype == torch.float64
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": sd}, buf)
    hits_before = opt.stats()["cache_hits"]

    train(model, [opt], 5, first_step=5)
    hits_run = opt.stats()["cache_hits"] - hits_before

    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = TinyGPT()
    resumed.load_state_dict(ckpt["model"])
    opt2 = make(resumed, **kw)
    opt2.load_state_dict(ckpt["optim"])
    assert torch.equal(opt2.state_dict()["state"][0]["cache_q"], entry["cache_q"])
    train(resumed, [opt2], 5, first_step=5)
    assert max_param_diff(model, resumed) == 0.0
    assert opt2.stats()["cache_hits"] == hits_run == 4 * CACHED  # 5..9: refresh at 5 only


def test_state_dict_without_cache_entries_loads_into_a_cached_optimizer() -> None:
    """Entries are optional state: a checkpoint of an uncached run starts them empty."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 3)
    sd = copy.deepcopy(opt.state_dict())
    copy_ = clone(model)
    cached = make(copy_, cache_gamma=1e6)
    cached.load_state_dict(sd)
    assert cached.param_groups[0]["cache_gamma"] is None  # group options come from the dict
    cached.param_groups[0]["cache_gamma"] = 1e6
    loaded = cached.state_dict()["state"][0]
    assert torch.equal(loaded["momentum_buffer"], sd["state"][0]["momentum_buffer"])
    assert loaded["cache_key"].tolist() == [0.0]  # empty: refreshes at its first use
    train(copy_, [cached], 2, first_step=3)
    st = cached.stats()
    assert st["cache_refreshes"] == CACHED and st["cache_hits"] == CACHED


def test_cache_gamma_with_standard_ns_says_it_never_hits() -> None:
    w = torch.nn.Parameter(torch.randn(16, 32))
    with pytest.warns(UserWarning, match="never hit the cache"):
        Muon([{"params": [w], "use_muon": True}], algorithm="ns", cache_gamma=5.0)


def _cache_ages(opt: Muon, params: list[torch.nn.Parameter]) -> list[float]:
    """The entries' ages (0: refreshed at the latest step, else hits since) of `params`."""
    order = [id(p) for g in opt.param_groups for p in g["params"]]
    state = opt.state_dict()["state"]
    return [state[order.index(id(p))]["cache_age"].item() for p in params]


def test_batch_gate_hits_or_refreshes_whole_batches() -> None:
    """cache_gate='batch' on TinyGPT, whose Muon matrices form two batches (qkv with proj: 16 x 48;
    fc with out_proj: 16 x 64), beside the per-matrix gate and fresh Muon stepped from the same
    parameters with the same gradients (so that all three see the same momentum): each batch
    hits or refreshes whole, a step where it refreshes updates its matrices as fresh Muon does
    (bit for bit, as test_tiny_gamma_never_reuses_and_equals_plain_muon), and it hits no more
    often than the per-matrix gate. The option survives a state_dict round trip."""
    torch.manual_seed(0)
    model = TinyGPT()
    others = {"matrix": clone(model), "fresh": clone(model)}
    gamma = 5.0  # here about a third of the matrices pass alone, often without their partner
    opt = make(model, cache_gamma=gamma, cache_gate="batch")
    other_opts = {"matrix": make(others["matrix"], cache_gamma=gamma), "fresh": make(others["fresh"])}
    batches = [("qkv", "proj"), ("fc", "out_proj")]
    refreshed = hit = 0
    for step in range(12):
        for m in others.values():
            m.load_state_dict(model.state_dict())
        for o in [opt, *other_opts.values()]:
            o.zero_grad()
        gpt_loss(model, step).backward()
        for m in others.values():
            for p, q in zip(model.parameters(), m.parameters()):
                q.grad = p.grad.clone()
        for o in [opt, *other_opts.values()]:
            o.step()
        for names in batches:
            ages = _cache_ages(opt, [getattr(model, n).weight for n in names])
            assert (ages[0] == 0) == (ages[1] == 0), f"step {step}: {names} decided apart ({ages})"
            if ages[0] > 0:
                hit += 1
                continue
            refreshed += 1
            for n in names:
                assert torch.equal(getattr(model, n).weight, getattr(others["fresh"], n).weight), (step, n)
    st, alone = opt.stats(), other_opts["matrix"].stats()
    assert hit > 0 and refreshed > 1  # both outcomes occurred after the first step
    assert st["cache_hits"] == 2 * hit and st["cache_hits"] + st["cache_refreshes"] == 12 * CACHED
    assert st["cache_batch_refreshes"] > 0 and alone["cache_batch_refreshes"] == 0
    assert st["cache_hit_rate"] < alone["cache_hit_rate"]

    sd = opt.state_dict()
    assert [g["cache_gate"] for g in sd["param_groups"] if g["use_muon"]] == ["batch"]
    resumed = make(clone(model), cache_gamma=gamma)
    resumed.load_state_dict(sd)
    assert [g["cache_gate"] for g in resumed.param_groups if g["use_muon"]] == ["batch"]

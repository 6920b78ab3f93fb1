"""Distributed equals single process: FSDP2 (2 and 4 ranks), HSDP (2 x 2), DDP and the gather
baseline (2 ranks) against one process on the same global batch; DCP checkpoints written at 2
ranks and resumed at 1, 2 and 4; gradients missing on some or all ranks; empty shards;
parameter sets that differ across ranks.

Real gloo ranks on the CPU, launched twice (2 and 4 ranks; each launch runs every scenario of
its world size, dist_scenarios.py) to keep the suite within CI's budget.

Tolerances. The ranks reduce gradients in another order than one process sums its batch, so
the runs differ by float32 rounding. Measured after 10 steps (max over parameters, losses):
FSDP2 x2 5.6e-7 / 4.8e-7, FSDP2 x4 1.0e-6 / 2.4e-7, HSDP 2x2 4.3e-7 / 4.8e-7, DDP x2 and gather
x2 5.6e-7 / 4.8e-7; resumed at 4 ranks 5.4e-7 / 4.8e-7, at 2 ranks exactly 0. Asserted:
parameters within PARAM_TOL, losses within LOSS_TOL. With CacheMuon reusing transforms, a hit's
update D = Q X multiplies the input's rounding gap by Q's eigenvalues (up to the product of the
iteration's a coefficients): the 3-row gate resumed at 4 ranks and in one process differed from
the 2-rank run by 6.7e-6 (torch 2.15, 2026-12-03; the other parameters by at most 6.6e-7), so
those runs are held to CACHE_PARAM_TOL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dist_scenarios as sc
from dist_harness import launch, max_diff, ok
from distmuon.torch import Muon

PARAM_TOL = 5e-6
CACHE_PARAM_TOL = 2e-5
LOSS_TOL = 2e-6

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp") / "step5"


@pytest.fixture(scope="module")
def world2(ckpt: Path) -> list[dict[str, Any]]:
    return launch(2, sc.world2, str(ckpt))


@pytest.fixture(scope="module")
def world4(world2: list[dict[str, Any]], ckpt: Path) -> list[dict[str, Any]]:
    assert "error" not in world2[0]["fsdp"], world2[0]["fsdp"]  # the checkpoint exists
    return launch(4, sc.world4, str(ckpt))


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    """The single-process reference: the whole global batch in one process."""
    model = sc.make_model()
    opt = Muon(model, **sc.OPT_KW)
    losses = sc.train(model, opt, range(sc.STEPS), 0, 1)
    return {"losses": losses, "params": sc.full_params(model), "mode": opt.dist_mode, "state": sc.full_state(opt)}


def assert_matches_single(ranks: list[dict[str, Any]], key: str, single: dict[str, Any], mode: str) -> None:
    for r in ranks:
        res = ok(r[key])
        assert res["mode"] == mode
        assert res["losses"] == pytest.approx(single["losses"], abs=LOSS_TOL, rel=0)
        assert max_diff(res["params"], single["params"]) < PARAM_TOL
    assert single["losses"][-1] < single["losses"][0]  # it trains


@pytest.fixture(scope="module")
def single_cache() -> dict[str, Any]:
    """The single-process reference with CacheMuon."""
    model = sc.make_model()
    opt = Muon(model, **sc.CACHE_KW)
    losses = sc.train(model, opt, range(sc.STEPS), 0, 1)
    return {"losses": losses, "params": sc.full_params(model), "mode": opt.dist_mode, "state": sc.full_state(opt)}


@pytest.mark.parametrize("launch, key", [(2, "fsdp"), (2, "ddp"), (2, "gather"), (4, "fsdp"), (4, "hsdp")])
def test_state_dict_equals_single_process_state(
    world2: list[dict[str, Any]], world4: list[dict[str, Any]], single: dict[str, Any], launch: int, key: str
) -> None:
    """Momentum gathered from its owners (or shards) and AdamW moments, in the parameter's
    placement, equal the single-process optimizer's state (same rounding gap as the weights)."""
    want = single["state"]
    for r in world2 if launch == 2 else world4:
        got = ok(r[key])["final_state"]
        assert got.keys() == want.keys()
        for i in want:
            assert got[i].keys() == want[i].keys()
            for k in want[i]:
                assert got[i][k].shape == want[i][k].shape
                torch.testing.assert_close(got[i][k], want[i][k], atol=PARAM_TOL, rtol=1e-5)


def test_single_process_reference_is_local(single: dict[str, Any]) -> None:
    assert single["mode"] == "local"


def test_fsdp2_two_ranks_equals_single_process(world2: list[dict[str, Any]], single: dict[str, Any]) -> None:
    assert_matches_single(world2, "fsdp", single, "sharded")
    # owners split the 7 matrices (4 + the gate + 2 experts): each rank computes some, not all
    owned = [ok(r["fsdp"])["owned"] for r in world2]
    assert sum(owned) == 7 and all(o > 0 for o in owned)


def test_tune_on_every_rank_before_and_during_training_changes_nothing_on_the_cpu(
    world2: list[dict[str, Any]], single: dict[str, Any]
) -> None:
    """Muon.tune() is collective and rebuilds the engines (carrying their state): on the CPU,
    whose backend is not tuned, every rank answers the heuristic for every Muon shape class and
    the run equals the single process's."""
    assert_matches_single(world2, "tune", single, "sharded")
    for r in world2:
        res = ok(r["tune"])
        assert res["rows"] and res["rows"] == res["again"]
        assert {row["source"] for row in res["rows"]} == {"heuristic"}


def test_fsdp2_four_ranks_with_empty_shards_equals_single_process(world4: list[dict[str, Any]], single: dict[str, Any]) -> None:
    assert_matches_single(world4, "fsdp", single, "sharded")


def test_hsdp_two_by_two_equals_single_process(world4: list[dict[str, Any]], single: dict[str, Any]) -> None:
    assert_matches_single(world4, "hsdp", single, "sharded")


def test_ddp_two_ranks_equals_single_process(world2: list[dict[str, Any]], single: dict[str, Any]) -> None:
    assert_matches_single(world2, "ddp", single, "replicated")


def test_gather_baseline_equals_single_process(world2: list[dict[str, Any]], single: dict[str, Any]) -> None:
    assert_matches_single(world2, "gather", single, "gather")


def test_a_bf16_wire_rounds_fsdp2s_rows_once_and_ddp_refuses_it(world2: list[dict[str, Any]]) -> None:
    """wire_dtype=torch.bfloat16: float32 gradient rows and updates travel in bfloat16, so the
    weights move a little off the float32 wire's (each step's rounding, compounded by training)
    and the loss follows; DDP's replicated mode moves weights and refuses it."""
    for r in world2:
        wire, exact = ok(r["fsdp_wire"]), ok(r["fsdp"])
        assert wire["mode"] == "sharded"
        init = sc.full_params(sc.make_model())
        moved = max_diff(exact["params"], init)
        off = max_diff(wire["params"], exact["params"])
        gap = abs(wire["losses"][-1] - exact["losses"][-1]) / exact["losses"][-1]
        print(f"[wire] bf16 rows, 2 gloo ranks, {len(exact['losses'])} steps: weights {off / moved:.3g} of "
              f"their change off the f32 wire's, final loss {gap:.2g} off")
        assert 0 < off < 0.1 * moved, (off, moved)  # training compounds each step's rounding
        assert gap < 0.01
        assert wire["losses"][-1] < wire["losses"][0]
    for r in world2:
        assert "applies to the sharded and gather modes" in r["ddp_wire"]["error"]


# ---- checkpoints -----------------------------------------------------------------------------


def test_checkpoint_resumed_at_same_world_size_continues_bit_identically(world2: list[dict[str, Any]]) -> None:
    for r in world2:
        run, resumed = ok(r["fsdp"]), ok(r["resume2"])
        assert resumed["losses"] == run["losses"][sc.CKPT_AT :]
        assert max_diff(resumed["params"], run["params"]) == 0.0


def test_checkpoint_resumed_at_four_ranks_restores_every_entry_and_continues(world2: list[dict[str, Any]], world4: list[dict[str, Any]]) -> None:
    run = ok(world2[0]["fsdp"])
    saved = run["saved_state"]
    for r in world4:
        resumed = ok(r["resume4"])
        loaded = resumed["loaded_state"]
        assert loaded.keys() == saved.keys()
        for i in saved:
            assert loaded[i].keys() == saved[i].keys()
            for k in saved[i]:
                assert torch.equal(loaded[i][k], saved[i][k]), (i, k)  # exact: momentum, AdamW, step
        assert resumed["losses"] == pytest.approx(run["losses"][sc.CKPT_AT :], abs=LOSS_TOL, rel=0)
        assert max_diff(resumed["params"], run["params"]) < PARAM_TOL


def test_checkpoint_resumed_in_one_process_continues(world2: list[dict[str, Any]], ckpt: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    run = ok(world2[0]["fsdp"])
    model = sc.make_model()
    opt = Muon(model, **sc.OPT_KW)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(sd, checkpoint_id=str(ckpt))
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    loaded = sc.full_state(opt)
    for i, entry in run["saved_state"].items():
        for k, v in entry.items():
            assert torch.equal(loaded[i][k], v), (i, k)
    losses = sc.train(model, opt, range(sc.CKPT_AT, sc.STEPS), 0, 1)
    assert losses == pytest.approx(run["losses"][sc.CKPT_AT :], abs=LOSS_TOL, rel=0)
    assert max_diff(sc.full_params(model), run["params"]) < PARAM_TOL


def test_torch_state_dict_api_round_trips_with_fqn_keys(world2: list[dict[str, Any]]) -> None:
    for r in world2:
        res = ok(r["fqn_api"])
        assert "fc.weight" in res["keys"] and "experts" in res["keys"]
        assert res["same"]


def test_ranks_plan_on_rank_zeros_measured_costs(world2: list[dict[str, Any]]) -> None:
    # Each rank's store holds other times for one of the four Muon shape classes: both ranks
    # plan on rank 0's (the plans agree, or set-up would have failed), analytic for the rest.
    costs = [ok(r["plan_costs"])["costs"] for r in world2]
    assert costs[0] == costs[1], costs
    assert costs[0].startswith("measured costs for 1 of 4 shapes (cpu"), costs[0]
    assert "analytic for the rest" in costs[0]


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["grad_none_fsdp", "grad_none_ddp"])
def test_missing_gradients(world2: list[dict[str, Any]], key: str) -> None:
    for r in world2:
        res = ok(r[key])
        # on every rank: the parameter is skipped (no decay, no state change), the rest steps
        assert res["all_none_gate_unchanged"] and res["all_none_others_changed"]
        assert res["gate_step"] == res["fc_step"] - 1
        # on some ranks: the same clear error on every rank, nothing applied anywhere
        assert "disagree on which parameters have a gradient" in res["some_none_error"]
        assert "gate.weight" in res["some_none_error"]
        assert res["some_none_unchanged"]
        assert res["recovered"]  # the optimizer steps normally afterwards


def test_missing_gradient_on_an_empty_shard_is_not_a_disagreement(world4: list[dict[str, Any]]) -> None:
    for r in world4:
        res = ok(r["grad_none_empty_shard"])
        assert res["some_none_error"] is None
        assert not res["some_none_unchanged"]


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_a_state_entry_deleted_on_every_rank_starts_fresh_as_in_one_process(world2: list[dict[str, Any]], kind: str) -> None:
    reference = ok(launch(1, sc.run_state_reset, "local")[0])
    assert reference["fc_step"] == sc.STEPS - sc.CKPT_AT
    for r in world2:
        res = ok(r[f"state_reset_{kind}"])
        assert res["fc_step"] == reference["fc_step"]
        assert res["losses"] == pytest.approx(reference["losses"], abs=LOSS_TOL, rel=0)
        assert max_diff(res["params"], reference["params"]) < PARAM_TOL


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_a_scheduler_stepped_on_one_rank_stops_the_step_everywhere(world2: list[dict[str, Any]], kind: str) -> None:
    # Each matrix takes its owner's options: before, rank 1's halved learning rate reached the
    # matrices it owns and rank 0's the others, silently.
    for r in world2:
        res = ok(r[f"lr_mismatch_{kind}"])
        assert "ranks step with different options" in res["step_error"]
        assert "rank 0 has `group 0 muon lr 0.02 " in res["step_error"]
        assert "rank 1 has `group 0 muon lr 0.01 " in res["step_error"]
        assert res["unchanged"]
        assert res["recovered"]


@pytest.mark.parametrize("what", ["missing", "shape"])
def test_parameter_sets_that_differ_across_ranks_fail_on_every_rank(world2: list[dict[str, Any]], what: str) -> None:
    for r in world2:
        res = r[f"mismatch_{what}"]
        assert "error" in res, "built an optimizer over different parameter sets"
        assert "ranks registered different parameters" in res["error"]
        assert "fc.weight" in res["error"]


def test_torch_communicator_collectives(world2: list[dict[str, Any]]) -> None:
    counts = [[2, 3], [1, 4]]
    for rank, r in enumerate(world2):
        res = ok(r["collectives"])
        assert res["max"] == [1.0, 0.0]
        assert res["broadcast"] == [1.0, 1.0, 1.0]
        want = [-1.0] * 12
        for src, displ in ((0, 6), (1, 1)):
            first = 5 if rank == 0 else 0  # the sender's displacement for this receiver
            n = counts[src][rank]
            want[displ : displ + n] = [100.0 * src + first + k for k in range(n)]
        assert res["a2a"] == want
        assert res["stats"]["ops"] == 4


def test_a_group_of_collectives_reaches_python_as_one_call(world2: list[dict[str, Any]]) -> None:
    """The torch communicator hands the engine's grouped() to Python as one batch() (DDP: each
    bucket's broadcasts of the updated weights), which completes as the single calls did."""
    for r in world2:
        res = ok(r["grouped"])
        assert res["alone"] == 0, res
        assert res["batches"] >= sc.STEPS and res["in_batch"] > res["batches"], res
        assert max_diff(res["params"], ok(r["ddp"])["params"]) == 0


# ---- CacheMuon ---------------------------------------------------------------------------------


@pytest.mark.parametrize("key, mode", [("fsdp_cache", "sharded"), ("gather_cache", "gather")])
def test_cache_muon_distributed_equals_single_process(
    world2: list[dict[str, Any]], single_cache: dict[str, Any], key: str, mode: str
) -> None:
    """Owners (sharded) or every rank (gather) keep the entries and reach the single process's
    decisions; the entries gathered by state_dict() equal the single process's."""
    assert_matches_single(world2, key, single_cache, mode)
    want = single_cache["state"]
    for r in world2:
        got = ok(r[key])["final_state"]
        for i in want:
            assert got[i].keys() == want[i].keys()
            for k in want[i]:
                # The transforms Q carry eigenvalues up to the product of the a coefficients, so
                # the gradients' rounding gap shows relative to their size.
                atol = 1e-5 * want[i][k].abs().max().item() if k == "cache_q" else PARAM_TOL
                torch.testing.assert_close(got[i][k], want[i][k], atol=atol, rtol=1e-4)
    hits = [ok(r[key])["stats"]["cache_hits"] for r in world2]
    # 10 steps: hits at 1, 2, 4, 5, 7, 8 for each of the 5 Gram-NS matrices (the 16 x 16 experts
    # run symmetric NS); gather: every rank counts every matrix
    assert sum(hits) == (6 * 5 if mode == "sharded" else 2 * 6 * 5)


def test_cache_entries_resume_at_four_ranks_and_in_one_process(
    world2: list[dict[str, Any]], world4: list[dict[str, Any]], ckpt: Path
) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    run = ok(world2[0]["fsdp_cache"])
    saved = run["saved_state"]
    assert any("cache_q" in e for e in saved.values())
    results = [ok(r["resume4_cache"]) for r in world4]
    model = sc.make_model()
    opt = Muon(model, **sc.CACHE_KW)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=sc.cache_ckpt(str(ckpt)))
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    loaded1 = sc.full_state(opt)
    losses1 = sc.train(model, opt, range(sc.CKPT_AT, sc.STEPS), 0, 1)
    results.append({"loaded_state": loaded1, "losses": losses1, "params": sc.full_params(model), "stats": opt.stats()})
    for res in results:
        for i, entry in saved.items():
            for k, v in entry.items():
                assert torch.equal(res["loaded_state"][i][k], v), (i, k)  # Q, age, key exactly
        assert res["losses"] == pytest.approx(run["losses"][sc.CKPT_AT :], abs=LOSS_TOL, rel=0)
        assert max_diff(res["params"], run["params"]) < CACHE_PARAM_TOL
    # steps 5..9 reuse the restored transforms (age 1 after step 4) at 5, 7, 8, refreshing at 6
    # and 9: 3 x 5 hits in all
    assert sum(r["stats"]["cache_hits"] for r in results[:4]) == 3 * 5
    assert results[4]["stats"]["cache_hits"] == 3 * 5

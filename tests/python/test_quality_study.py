"""The training-quality study (bench/quality) at a tiny size on the CPU: the batch plan, that
every arm of a seed trains on the same weights and batches, the records the report reads, and
the report itself (bench/quality/README.md describes the study)."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "quality"))

import common  # noqa: E402
import lm  # noqa: E402
import report  # noqa: E402

FRESH = "distmuon:algo=gram-ns"
# A staleness schedule with the residual off: every entry serves 2 steps after its refresh, so
# the cache hits from the second step on whatever the residuals are.
STALE = "distmuon:algo=gram-ns:gamma=1e6:staleness=2"
STEPS = 6


def test_batch_plan_visits_each_window_once_per_epoch_and_depends_only_on_the_seed():
    n, context, batch, steps = 1000, 10, 7, 30
    starts, epochs = common.batch_plan(n, context, batch, steps, seed=3)
    per_epoch = (n - context) // context
    assert starts.shape == (steps, batch)
    assert epochs == pytest.approx(steps * batch / per_epoch)
    flat = starts.reshape(-1).tolist()
    for epoch in (flat[:per_epoch], flat[per_epoch:2 * per_epoch]):
        assert len(set(epoch)) == per_epoch  # no window twice in an epoch
        assert len({s % context for s in epoch}) == 1  # non-overlapping: one offset per epoch
    assert min(flat) >= 0 and max(flat) + context + 1 <= n  # every target inside the corpus
    assert torch.equal(starts, common.batch_plan(n, context, batch, steps, seed=3)[0])
    assert not torch.equal(starts, common.batch_plan(n, context, batch, steps, seed=4)[0])
    with pytest.raises(ValueError, match="fewer than a batch"):
        common.batch_plan(50, context, batch, steps, seed=0)


def test_arm_options_are_parsed_and_checked():
    arm = common.parse_arm("distmuon:algo=gram-ns:gamma=15:probes=8")
    assert (arm.gamma, arm.probes, arm.staleness) == (15.0, 8, 0)
    assert "γ=15" in arm.label and "probes=8" in arm.label
    stale = common.parse_arm(STALE)
    assert stale.staleness == 2 and "γ" not in stale.label and "staleness=2" in stale.label
    with pytest.raises(ValueError, match="give gamma"):
        common.parse_arm("distmuon:algo=gram-ns:probes=8")
    with pytest.raises(ValueError, match="unknown key"):
        common.parse_arm("distmuon:algo=gram-ns:gama=2")
    with pytest.raises(ValueError, match="staleness and backoff >= 0"):
        common.parse_arm("distmuon:algo=gram-ns:gamma=2:staleness=-1")
    backoff = common.parse_arm("distmuon:algo=gram-ns:gamma=2:backoff=8")
    assert backoff.backoff == 8 and "backoff=8" in backoff.label
    with pytest.raises(ValueError, match="give gamma"):
        common.parse_arm("distmuon:algo=gram-ns:backoff=8")
    gate = common.parse_arm("distmuon:algo=gram-ns:gamma=2:gate=batch")
    assert gate.gate == "batch" and "gate=batch" in gate.label
    assert common.parse_arm("distmuon:algo=gram-ns:gamma=2").gate == "matrix"
    with pytest.raises(ValueError, match="gate must be"):
        common.parse_arm("distmuon:algo=gram-ns:gamma=2:gate=layer")
    with pytest.raises(ValueError, match="give gamma"):
        common.parse_arm("distmuon:algo=gram-ns:gate=batch")


def test_a_misspelt_arm_fails_before_any_arm_trains(tmp_path):
    out = tmp_path / "lm.json"
    with pytest.raises(ValueError, match="unknown arm"):
        lm.main(["--size", "tiny", "--device", "cpu", "--arms", "adamw:lr=1e-3,sgd", "--out", str(out)])
    assert not out.exists()


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Three arms trained for a few steps at the tiny size, their raw record and the report."""
    out = tmp_path_factory.mktemp("quality")
    raw = out / "quality-lm-tiny.json"
    lm.main(["--size", "tiny", "--device", "cpu", "--seeds", "0", "--steps", str(STEPS), "--eval-every", "3",
             "--val-windows", "8", "--arms", f"adamw:lr=1e-3,{FRESH},{STALE}", "--out", str(raw)])
    report.main(["--lm", str(raw), "--out", str(out / "rep" / "quality")])
    return out, json.loads(raw.read_text())


def test_every_arm_trains_on_the_same_weights_and_batches(study):
    _, rec = study
    arms = rec["arms"]
    assert [a["arm"] for a in arms] == ["adamw:lr=1e-3", FRESH, STALE]
    # The digest is that of the batches the seed's plan gives (recomputed here from the corpus).
    meta = rec["meta"]
    corpus = lm.CharData(ROOT / "data" / "tinyshakespeare.txt", torch.device("cpu"))
    starts, _ = common.batch_plan(len(corpus.train), meta["context"], meta["batch"], STEPS, seed=0)
    h = hashlib.sha256()
    for row in starts.tolist():
        h.update(torch.stack([corpus.train[j:j + meta["context"]] for j in row]).numpy().tobytes())
        h.update(torch.stack([corpus.train[j + 1:j + 1 + meta["context"]] for j in row]).numpy().tobytes())
    assert {a["batch_digest"] for a in arms} == {h.hexdigest()[:16]}
    assert len({a["init_digest"] for a in arms}) == 1 and arms[0]["init_digest"]
    # ... and only the optimizer differs: AdamW and Muon leave different losses.
    assert arms[0]["val"] != arms[1]["val"]


def test_records_hold_what_the_report_needs(study):
    _, rec = study
    for a in rec["arms"]:
        assert len(a["opt_ms"]) == len(a["ortho_flops"]) == STEPS
        assert all(t > 0 for t in a["opt_ms"])
        assert a["steps"] == [3, 6] and len(a["val"]) == 2
        assert all(math.isfinite(v) for v in a["val"]) and a["final"] == a["val"][-1]
    adamw, fresh, stale = rec["arms"]
    assert sum(adamw["ortho_flops"]) == 0 and sum(fresh["ortho_flops"]) > 0
    assert len(stale["hit_rate"]) == STEPS and max(stale["hit_rate"]) > 0  # the schedule reused transforms
    assert sum(stale["ortho_flops"]) < sum(fresh["ortho_flops"])
    assert rec["meta"]["epochs"] > 0 and rec["meta"]["params"] > 0


def test_report_renders_the_frontier_and_the_table(study):
    out, rec = study
    rep = out / "rep"
    md = (rep / "quality.md").read_text()
    for a in rec["arms"]:
        assert f"| {a['label']} |" in md
    assert "digests equal" in md
    for plot in ("curves", "frontier", "hits"):
        assert (rep / f"quality-lm-tiny-{plot}.png").stat().st_size > 1000
    summary = json.loads((rep / "quality-lm-tiny-summary.json").read_text())
    assert summary["inputs_identical"] is True
    rows = {r["arm"]: r for r in summary["arms"]}
    stale, fresh = rows[STALE], rows[FRESH]
    assert stale["flops_saved"] == pytest.approx(1 - stale["ortho_gflop"] / fresh["ortho_gflop"])
    assert stale["flops_saved"] > 0 and fresh["flops_saved"] == 0
    assert stale["final_vs_fresh"] == pytest.approx(stale["final"] / fresh["final"] - 1)
    assert rows["adamw:lr=1e-3"]["flops_saved"] is None
    assert "no slower than fresh: " in md  # the targets, checked on these rows


def test_targets_are_judged_against_fresh():
    def row(arm, saved, time, loss):
        return {"arm": arm, "label": arm, "flops_saved": saved, "time_vs_fresh": time, "final_vs_fresh": loss}

    lines = "\n".join(report.target_lines([
        row(FRESH, 0.0, 1.0, 0.0),
        row("gram-ns:gamma=2", -0.1, 1.2, 0.0),        # slower than fresh
        row("gram-ns:gamma=30", 0.6, 0.6, 0.005),      # >= 50 % saved, fast and accurate enough
        row("gram-ns:gamma=1e6:staleness=3", 0.7, 0.6, 0.02)]))  # fast, but 2 % worse
    assert "not met** by gram-ns:gamma=2 (1.20x)" in lines and "gamma=30 (" not in lines
    assert "gram-ns:gamma=30 saves 60.0 % of the FLOPs: time 0.60x" in lines
    assert lines.count("): met") == 1 and "+2.0 % (target <= +1 %): **not met**" in lines


def test_summary_flags_an_arm_that_ends_worse_than_its_best(study):
    _, rec = study
    arm = rec["arms"][1]
    ended_worse = dict(arm, arm="worse", val=[2.0, 1.5, 1.52], final=1.52)  # 1.3 % above its best
    ended_near = dict(arm, arm="near", val=[2.0, 1.5, 1.51], final=1.51)    # 0.7 %
    rows = {r["arm"]: r for r in report.summarize({"meta": {"kind": "lm"}, "arms": [ended_worse, ended_near]})}
    assert rows["worse"]["overfit"] and not rows["near"]["overfit"]
    assert rows["worse"]["best"] == 1.5
    # An arm that diverged (every evaluation NaN) is reported, not a crash.
    diverged = dict(arm, arm="nan", val=[math.nan, math.nan], final=math.nan)
    row = report.summarize({"meta": {"kind": "lm"}, "arms": [diverged]})[0]
    assert math.isnan(row["final"]) and math.isnan(row["best"]) and not row["overfit"]
    # Seeds are averaged, and a differing batch digest within a seed is caught.
    seeds = [dict(arm, seed=0, final=1.5, val=[1.5]), dict(arm, seed=1, final=1.7, val=[1.7])]
    row = report.summarize({"meta": {"kind": "lm"}, "arms": seeds})[0]
    assert row["final"] == pytest.approx(1.6) and row["final_spread"] == pytest.approx(0.2)
    assert report.inputs_identical({"arms": seeds})
    assert report.inputs_identical({"arms": [dict(arm), dict(arm, batch_digest="0" * 16)]}) is False
    assert report.inputs_identical({"arms": [dict(arm, batch_digest="")]}) is None  # not recorded


def test_runs_of_one_size_are_merged_and_a_seed_twice_is_refused(study, tmp_path):
    """Seeds run in separate device calls report as one study of their size."""
    _, rec = study
    seed1 = {"meta": dict(rec["meta"], seeds="1", command="lm.py --seeds 1"),
             "arms": [dict(a, seed=1, final=a["final"] + 0.5) for a in rec["arms"]]}
    paths = [tmp_path / "s0.json", tmp_path / "s1.json"]
    paths[0].write_text(json.dumps(rec))
    paths[1].write_text(json.dumps(seed1))
    [merged] = report.load_lm([str(p) for p in paths])
    assert merged["meta"]["seeds"] == "0,1" and "lm.py --seeds 1" in merged["meta"]["command"]
    assert len(merged["arms"]) == 2 * len(rec["arms"])
    row = {r["arm"]: r for r in report.summarize(merged)}[FRESH]
    assert row["seeds"] == [0, 1] and row["final_spread"] == pytest.approx(0.5)
    with pytest.raises(SystemExit, match="seed 0 is in two"):
        report.load_lm([str(paths[0]), str(paths[0])])

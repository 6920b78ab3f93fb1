"""bench/cluster/report.py on a recorded cluster run (the H200's bucket A/B at D = 8) with the
simulator as built: each run is predicted with its own bucket size and planner, a calibrated
all-to-all rate reaches the sharded mode's prediction alone and a calibrated AdamW rate the AdamW
baseline's, and a record without a whole-GPU calibration needs --whole-gpu, said in one line."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "bench" / "cluster" / "report.py"
RESULTS = REPO / "bench" / "results"
AB = RESULTS / "2026-12-06-h200-cluster-ab" / "cluster.json"
H100 = RESULTS / "2026-12-06-h100-cluster"
PLAN = REPO / os.environ.get("BUILD_DIR", "build") / "bin" / "distmuon-plan"

pytestmark = pytest.mark.skipif(not PLAN.exists(), reason=f"{PLAN} is not built")


def report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPORT), "--plan", str(PLAN),
                           "--costs", str(H100 / "sim-calibration" / "costs.json"), *args],
                          capture_output=True, text=True, timeout=300)


def test_resimulation_predicts_each_run_with_its_buckets_and_planner(tmp_path: Path) -> None:
    r = report("--resimulate", str(AB), "--whole-gpu", str(H100 / "cluster.json"), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    runs = json.loads(AB.read_text())["runs"]
    rows = json.loads((tmp_path / "resimulated.json").read_text())["runs"]
    assert len(rows) == len(runs)
    for run, row in zip(runs, rows):
        assert (row["workload"], row["mode"], row["step_ms"]) == (run["workload"], run["mode"], run["step_ms"])
        assert row["bucket_mb"] == run["bucket_mb"] and row["planner"] == run["planner"]
        assert row["predicted_ms"] > 0 and math.isclose(row["error"], row["predicted_ms"] / row["step_ms"] - 1)
    # One set-up per bucket size: 32 MiB issues more collectives than 1 GiB for the same run.
    by = {(x["workload"], x["mode"], x["planner"], x["bucket_mb"]): x for x in rows}
    for (w, m, planner, mb), x in by.items():
        if mb == 32 and m == "sharded" and (w, m, planner, 1024.0) in by:
            assert x["collectives"] > by[(w, m, planner, 1024.0)]["collectives"]
    # Each row's predicted engine step over gather's predicted one: the owner modes gain at D = 8.
    for x in rows:
        if x["mode"] in ("sharded", "dedicated"):
            assert x["predicted_engine_x_gather"] > 1
    assert (tmp_path / "resimulated.md").read_text().count("\n| ") == len(rows) + 1
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "resimulated.png").stat().st_size > 0


def load_report():
    spec = importlib.util.spec_from_file_location("cluster_report", REPORT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ARGS = argparse.Namespace(collective_latency_us=143, local_collective_us=10,
                          comm_compute_share=0.75, comm_wait_share=None, grouped_hop_share=None)


class Predictor:
    """report.predict() on gpt2-large (4 layers, D = 2) with a calibration of the H100 record;
    `cmds[-1]` is the simulator command it ran."""

    def __init__(self, monkeypatch) -> None:
        self.rep = load_report()
        self.cals = json.loads((H100 / "cluster.json").read_text())["calibration"]
        self.cmds: list[list[str]] = []
        run = subprocess.run
        monkeypatch.setattr(self.rep.subprocess, "run",
                            lambda cmd, **kw: self.cmds.append(cmd) or run(cmd, **kw))

    def __call__(self, cal: dict) -> dict:
        rec = {"workload": "gpt2-large", "layers": 4, "ranks": 2, "planner": "lpt",
               "batches_per_bucket": False, "bucket_mb": 1024, "calibration": cal, "mechanism": "mps"}
        p = self.rep.predict(str(PLAN), rec, {"calibration": self.cals["1"]},
                             str(H100 / "sim-calibration" / "costs.json"), ARGS)
        assert p is not None
        return p

    def flag(self, name: str) -> float:
        return float(self.cmds[-1][self.cmds[-1].index(name) + 1])


def test_a_calibrated_all_to_all_rate_reaches_the_sharded_step_alone(monkeypatch) -> None:
    predict = Predictor(monkeypatch)
    cal = predict.cals["2"]
    old = predict(cal)  # recorded before the all-to-all was calibrated: no rate of its own
    assert "--intra-alltoall-gbs" not in predict.cmds[-1]
    fast = dict(cal, nccl_alltoall_busbw_gbs=4 * cal["nccl_allgather_busbw_gbs"])
    new = predict(fast)
    # (D-1)/D * bytes over the bus bandwidth, less the issue time the calibration timed with it
    want = predict.rep.issue_free_gbs(fast["nccl_alltoall_busbw_gbs"], 0.5, ARGS.collective_latency_us)
    assert math.isclose(predict.flag("--intra-alltoall-gbs"), want, rel_tol=1e-5)
    assert new["sharded"] < old["sharded"]
    assert new["gather"] == old["gather"] and new["dedicated"] == old["dedicated"]


def test_a_calibrated_adamw_rate_reaches_the_adamw_baseline_alone(monkeypatch) -> None:
    predict = Predictor(monkeypatch)
    cal = predict.cals["2"]
    old = predict(cal)  # recorded before the AdamW pass was calibrated: the copy rate
    assert "--adamw-tbs" not in predict.cmds[-1]
    slow = dict(cal, adamw_gbs_per_rank_min=cal["copy_gbs_per_rank_min"] / 2)
    new = predict(slow)
    assert math.isclose(predict.flag("--adamw-tbs"), slow["adamw_gbs_per_rank_min"] / 1e3, rel_tol=1e-5)
    assert new["adamw"] > old["adamw"]
    assert all(new[m] == old[m] for m in ("gather", "sharded", "dedicated"))


def test_a_record_without_a_whole_gpu_calibration_needs_one(tmp_path: Path) -> None:
    r = report("--resimulate", str(AB), "--out", str(tmp_path))
    assert r.returncode != 0
    assert "no whole-GPU (D = 1) calibration" in r.stderr and "--whole-gpu" in r.stderr
    assert not (tmp_path / "resimulated.json").exists()


def test_a_run_of_the_e2e_stage_alone_is_recorded(tmp_path: Path) -> None:
    for opt, step, engine in (("adamw", 100.0, {}), ("distmuon-sharded", 110.0, {"engine_peak_gib": 1.25, "engine_issue_ms": 2.5})):
        (tmp_path / f"e2e-8-{opt}.json").write_text(json.dumps({
            "world_size": 8, "config": "qwen2.5-0.5b", "seq": 1536, "gpu": "NVIDIA H100 80GB HBM3",
            "results": [{"optimizer": opt, "step_ms": step, "fwd_bwd_ms": 90.0,
                         "optimizer_ms": step - 90.0, "final_loss": 11.9, "peak_mem_gib": 7.5, **engine}]}))
    r = subprocess.run([sys.executable, str(REPORT), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "cluster.json").read_text())
    assert rec["runs"] == [] and rec["gpu"] == "NVIDIA H100 80GB HBM3" and rec["mechanism"] == ["mps"]
    by = {e["optimizer"]: e for e in rec["e2e"]}
    assert by["adamw"]["step_over_adamw"] == 1.0
    assert math.isclose(by["distmuon-sharded"]["step_over_adamw"], 1.1)
    md = (tmp_path / "cluster.md").read_text()
    assert "| 8 | distmuon-sharded | 110.0 | 1.100 |" in md and "| 7.5 / 1.2 |" in md  # PyTorch's / the engines'
    assert by["distmuon-sharded"]["engine_peak_gib"] == 1.25 and by["adamw"]["engine_peak_gib"] is None
    # The optimizer's time with the engines' host share beside it, where the run has engines.
    assert "| 20.0 (2.5) | 11.9000 |" in md and "| 10.0 | 11.9000 |" in md


def test_a_d_without_a_calibration_is_predicted_on_the_largest_scaled() -> None:
    rec = RESULTS / "2026-12-07-h100-cluster"
    r = report("--predict", "8,16", "--from-record", str(rec / "cluster.json"), "--costs", str(rec / "costs.json"),
               "--workloads", "pi0:6")
    assert r.returncode == 0, r.stderr
    rows = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[3:8]]
            for line in r.stdout.splitlines() if line.startswith("| pi0 |")}
    assert rows["8"][-1] == "recorded" and rows["16"][-1] == "D = 8's scaled"
    # Half the part's rates and twice the ranks' traffic: every mode slower than at D = 8.
    assert all(float(b) > float(a) for a, b in zip(rows["8"][:4], rows["16"][:4]))


def test_an_all_to_all_timed_on_windows_is_simulated_in_equal_blocks(monkeypatch) -> None:
    """A calibration that timed the all-to-all on the communicator's windows (the sharded mode's
    equal blocks under DISTMUON_NCCL_CTA_POLICY=zero) has the sharded step simulated in equal
    blocks; the other modes do not move."""
    predict = Predictor(monkeypatch)
    cal = predict.cals["2"]
    old = predict(cal)
    assert "--uniform-all-to-all" not in predict.cmds[-1]
    new = predict(dict(cal, nccl_alltoall_on_windows=True))
    assert "--uniform-all-to-all" in predict.cmds[-1]
    assert new["sharded"] >= old["sharded"]  # every pair its bucket's largest: never fewer bytes
    assert new["gather"] == old["gather"] and new["dedicated"] == old["dedicated"]


def test_the_all_to_all_scale_speeds_the_sharded_step_alone(monkeypatch, tmp_path: Path) -> None:
    """--alltoall-scale F (what if the all-to-all ran F times its calibrated rate): the sharded
    prediction shrinks, no other mode's moves; a scale <= 0 is refused."""
    predict = Predictor(monkeypatch)
    cal = json.loads((RESULTS / "2026-12-07-h100-cluster" / "cluster.json").read_text())["calibration"]["2"]
    assert cal.get("nccl_alltoall_busbw_gbs")  # timed there
    old = predict(cal)
    rate = predict.flag("--intra-alltoall-gbs")
    monkeypatch.setattr(ARGS, "alltoall_scale", 4.0, raising=False)
    new = predict(cal)
    assert predict.flag("--intra-alltoall-gbs") > 3.9 * rate
    assert new["sharded"] < old["sharded"]
    assert new["gather"] == old["gather"] and new["dedicated"] == old["dedicated"]
    r = report("--resimulate", str(AB), "--alltoall-scale", "0", "--out", str(tmp_path))
    assert r.returncode != 0 and "--alltoall-scale must be positive" in r.stderr

"""examples/train_gpt.py as a user runs it: bad arguments are refused by argparse (exit 2, one
`error:` line, before any training) instead of a traceback from deep inside; a tiny run trains
with every optimizer and writes its summary."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_gpt.py"
TINY = ["--steps", "2", "--batch-size", "2", "--block-size", "8", "--n-layer", "1", "--n-head", "1",
        "--n-embd", "16", "--eval-iters", "1", "--threads", "1"]


def run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *TINY, "--out", str(tmp_path / "c.png"), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cache-gamma", "0"], "--cache-gamma must be a finite number > 0"),
        (["--cache-gamma", "nan"], "--cache-gamma must be a finite number > 0"),
        (["--threads", "-1"], "--threads must be >= 0"),
        (["--warmup", "-3"], "--warmup must be >= 0"),
        (["--data", "/no/such/file.txt"], "--data /no/such/file.txt: no such file"),
        (["--device", "cpux"], "--device cpux:"),
        (["--optimizer", "adamw", "--adamw-lr", "-1"], "--adamw-lr must be a finite number > 0"),
        (["--baseline-budget-s", "-1"], "--baseline-budget-s must be >= 0"),
        (["--baseline-budget-s", "inf"], "--baseline-budget-s must be a finite number of seconds"),
    ],
)
def test_bad_arguments_are_refused_before_training(args: list[str], message: str, tmp_path: Path) -> None:
    r = run(args, tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"train_gpt.py: error: {message}" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "c.json").exists()


def test_a_tiny_run_trains_every_optimizer(tmp_path: Path) -> None:
    r = run(["--optimizer", "distmuon,torch-muon,adamw"], tmp_path)
    assert r.returncode == 0, r.stderr
    results = json.loads((tmp_path / "c.json").read_text())["results"]
    assert [x["optimizer"] for x in results] == ["distmuon", "torch-muon", "adamw"]
    for x in results:
        assert math.isfinite(x["final_val_loss"]) and x["final_val_loss"] < 4.5  # log(65) = 4.17 at start
        assert len(x["val_points"]) == 2
    assert results[0]["stats"]["steps"] == 2 and results[0]["stats"]["ortho_flops"] > 0
    # the thread settings it used (--threads 1: torch's pool, and the engine's loops with it)
    threads = json.loads((tmp_path / "c.json").read_text())["threads"]
    assert threads["torch_threads"] == 1 and threads["distmuon_threads"] == 1, threads
    assert threads["distmuon_backend"].startswith("cpu (") and "CPU threads: torch 1" in r.stdout
    assert (tmp_path / "c.png").stat().st_size > 0


def test_a_baseline_over_its_budget_stops_at_an_evaluation_step(tmp_path: Path) -> None:
    """--baseline-budget-s: a baseline projected past the budget after its first steps stops at
    the last evaluation step that fits (here the first: a budget of a microsecond), distmuon runs
    every step, and the summary compares both at that step; without a budget nothing stops."""
    args = ["--optimizer", "distmuon,torch-muon", "--steps", "12", "--eval-every", "6"]
    r = run([*args, "--baseline-budget-s", "1e-6"], tmp_path)
    assert r.returncode == 0, r.stderr
    ours, torch_muon = json.loads((tmp_path / "c.json").read_text())["results"]
    assert ours["stopped_at"] is None and [s for s, _ in ours["val_points"]] == [6, 12]
    assert torch_muon["stopped_at"] == 6 and [s for s, _ in torch_muon["val_points"]] == [6]
    assert "torch-muon: " in r.stdout and "stops at step 6 of 12" in r.stdout
    assert f"its validation loss there {torch_muon['final_val_loss']:.4f}, distmuon's {ours['val_points'][0][1]:.4f}" in r.stdout
    r = run(args, tmp_path)
    assert r.returncode == 0, r.stderr
    assert all(x["stopped_at"] is None for x in json.loads((tmp_path / "c.json").read_text())["results"])

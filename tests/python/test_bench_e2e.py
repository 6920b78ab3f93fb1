"""The cluster's end-to-end benchmark as bench/cluster/run.sh runs it, on 2 gloo ranks: one
torchrun per optimizer (bench/multi_gpu/e2e_train.py), then report.py's merge, whose ratio over
AdamW spans the files."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "bench" / "multi_gpu" / "e2e_train.py"


def load_report():
    spec = importlib.util.spec_from_file_location("cluster_report", REPO / "bench" / "cluster" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train(optimizer: str, out: Path, port: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
         str(TRAIN), "--device", "cpu", "--config", "tiny", "--seq", "16", "--steps", "2", "--warmup", "1",
         "--optimizers", optimizer, "--progress", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert f"{optimizer}: step 3 of 3" in r.stdout  # --progress
    return json.loads(out.read_text())


def test_one_run_per_optimizer_merges_with_the_ratio_over_adamw(tmp_path: Path) -> None:
    runs = {opt: train(opt, tmp_path / f"e2e-2-{opt}.json", 29610 + i)
            for i, opt in enumerate(["adamw", "distmuon-sharded", "distmuon-dedicated", "distmuon-dedicated-serial"])}
    for opt, rec in runs.items():
        assert rec["world_size"] == 2
        (r,) = rec["results"]
        assert r["optimizer"] == opt and r["step_ms"] > 0 and math.isfinite(r["final_loss"])
        assert 0 < r["fwd_ms"] < r["fwd_bwd_ms"] < r["step_ms"]
        # distmuon's runs say what their engines hold and what issuing a step cost the host.
        if opt == "adamw":
            assert "engine_issue_ms" not in r and "engine_peak_gib" not in r
        else:
            assert 0 < r["engine_issue_ms"] < r["optimizer_ms"]
            assert r["engine_peak_gib"] > 0
    merged = load_report().e2e_runs(str(tmp_path))
    assert sorted(r["optimizer"] for r in merged) == ["adamw", "distmuon-dedicated", "distmuon-dedicated-serial",
                                                      "distmuon-sharded"]
    adamw = runs["adamw"]["results"][0]["step_ms"]
    for r in merged:
        mine = runs[r["optimizer"]]["results"][0]["step_ms"]
        assert r["ranks"] == 2 and math.isclose(r["step_over_adamw"], mine / adamw)


def test_without_adamw_there_is_no_ratio(tmp_path: Path) -> None:
    (tmp_path / "e2e-2-distmuon-sharded.json").write_text(json.dumps(
        {"world_size": 2, "config": "tiny", "results": [
            {"optimizer": "distmuon-sharded", "step_ms": 3.0, "fwd_bwd_ms": 2.0, "optimizer_ms": 1.0,
             "final_loss": 5.0}]}))
    (r,) = load_report().e2e_runs(str(tmp_path))
    assert r["step_over_adamw"] is None and r["loss"] == 5.0


def test_the_chunked_loss_equals_the_whole_one() -> None:
    """Qwen's loss a chunk of tokens at a time (logits recomputed in backward) gives the loss and
    the gradients of the whole logits."""
    import torch

    sys.path.insert(0, str(TRAIN.parent))
    from qwen_model import Qwen, QwenConfig

    torch.manual_seed(0)
    model = Qwen(QwenConfig.named("tiny"))
    idx = torch.randint(0, 512, (2, 13))
    grads = []
    for chunk in (0, 5):  # 26 tokens: chunks of 5, the last one short
        model.zero_grad()
        loss = model(idx[:, :-1], idx[:, 1:], loss_chunk=chunk)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (whole, gw), (chunked, gc) = grads
    assert torch.allclose(whole, chunked, rtol=1e-6, atol=1e-6)
    for a, b in zip(gw, gc):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_trainer_runs_with_a_chunked_loss_and_small_buckets(tmp_path: Path) -> None:
    """Under FSDP2 the chunked loss trains as the whole one, and distmuon's small buckets as its
    default one: the same loss after two steps (the second step's loss depends on the first
    step's gradients)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    losses = []
    for i, (chunk, bucket_mb) in enumerate(((0, None), (6, None), (0, 0.01))):
        out = tmp_path / f"e2e-{chunk}.json"
        r = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
             str(29615 + i), str(TRAIN), "--device", "cpu", "--config", "tiny", "--seq", "16",
             "--steps", "1", "--warmup", "1", "--loss-chunk", str(chunk), "--optimizers",
             "distmuon-sharded", "--json", str(out)] + (["--bucket-mb", str(bucket_mb)] if bucket_mb else []),
            capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        rec = json.loads(out.read_text())
        assert rec["loss_chunk"] == chunk and rec["bucket_mb"] == bucket_mb
        losses.append(rec["results"][0]["final_loss"])
    assert math.isfinite(losses[0])
    assert all(math.isclose(losses[0], x, rel_tol=1e-5) for x in losses[1:]), losses


def test_an_unknown_optimizer_is_refused_before_training() -> None:
    r = subprocess.run([sys.executable, str(TRAIN), "--device", "cpu", "--optimizers", "adamw,distmuon-foo"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown --optimizers ['distmuon-foo']" in r.stderr, r.stderr[-2000:]


def test_profile_writes_a_trace_and_a_summary_with_the_optimizer_range(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    prof = tmp_path / "prof"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29620",
         str(TRAIN), "--device", "cpu", "--config", "tiny", "--seq", "16", "--steps", "2", "--warmup", "1",
         "--optimizers", "distmuon-sharded", "--profile", str(prof), "--json", str(tmp_path / "e.json")],
        capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert json.loads((prof / "trace-distmuon-sharded.json").read_text())["traceEvents"]
    summary = (prof / "summary-distmuon-sharded.txt").read_text()
    assert "by host time" in summary and "optimizer.step" in summary

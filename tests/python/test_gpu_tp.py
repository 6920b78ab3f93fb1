"""Tensor and expert parallelism over NCCL, on this machine's GPUs, against one process on the
same global batch: dp 2 x tp 2 (MLP tensor-parallel, attention whole over tp, experts split
along their matrices; a DCP checkpoint after 3 steps), ep 2 x dp 2 with and without FSDP2 on the
experts (a DCP checkpoint as well), 4 ranks each (tp_scenarios.py's scenarios, the gloo suite's
test_tp.py on CUDA); each checkpoint resumed in one process on CUDA. Skipped as
test_gpu_distributed.py is (its _skip_reason: no GPU, distmuon without CUDA, torch without NCCL,
or more ranks than GPUs where NCCL cannot share one).

Tolerances: those of test_gpu_distributed.py's float32 arms (PARAM_TOL 5e-5, LOSS_TOL 2e-5).
Newton-Schulz runs in float32 in the ranks and the reference (ns_dtype), so what differs is
what differs on gloo (the ranks sum gradients in another order than one process; gloo measured
5.8e-7 / 7.8e-7 after 5 steps) plus cuBLAS kernels chosen for other batch shapes (each dp rank
runs half the batch, tensor-parallel ranks half the MLP): well below 5e-5, while a matrix left
out of a step differs by lr * steps * 0.25 ~ 0.02. The momentum and AdamW moments are compared
alike. A checkpoint's entries load bit for bit (torch.equal), as on gloo. Each arm's largest
differences go to DISTMUON_TEST_REPORT with test_gpu_distributed.py's (the same report: run in
one pytest invocation, after it).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import tp_scenarios as sc
from dist_harness import launch, max_diff, ok
from distmuon.torch import Muon
from test_gpu_distributed import LOSS_TOL, PARAM_TOL, _skip_reason, on_cuda, record  # noqa: F401

# on_cuda (imported: autouse here too) makes the single-process references run on CUDA and
# writes the report, this module's arms included, when the module ends.

pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp-nccl-tp") / "step3"


@pytest.fixture(scope="module")
def nccl4(ckpt: Path) -> list[dict[str, Any]]:
    return launch(4, sc.nccl_world4, str(ckpt), backend="nccl", timeout_s=420)


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    """One process on CUDA on the whole global batch, Newton-Schulz in float32 as the ranks."""
    model = sc.make_model()
    initial = sc.full_params(model)
    opt = Muon(model, **sc.NCCL_KW)
    losses = sc.train(model, opt, range(sc.STEPS))
    params = sc.full_params(model)
    return {"losses": losses, "params": params, "state": sc.full_state(opt), "moved": max_diff(params, initial)}


def check(results: list[dict[str, Any]], key: str, ref: dict[str, Any], arm: str) -> dict[str, Any]:
    """Every rank's losses, parameters and optimizer state (momentum, AdamW moments; whole)
    against the single process; the largest differences recorded as `arm`. Rank 0's result."""
    param_diff = loss_diff = 0.0
    for r in results:
        res = ok(r[key])
        assert res["mode"] == "sharded"
        loss_diff = max(loss_diff, max(abs(a - b) for a, b in zip(res["losses"], ref["losses"])))
        param_diff = max(param_diff, max_diff(res["params"], ref["params"]))
        for i, entry in ref["state"].items():
            for k, v in entry.items():
                torch.testing.assert_close(res["state"][i][k], v, atol=PARAM_TOL, rtol=1e-5, msg=f"{arm}: {i} {k}")
    record(arm, len(results), param_diff, loss_diff)
    assert loss_diff <= LOSS_TOL, f"{arm}: losses differ by {loss_diff:.3e}"
    assert param_diff <= PARAM_TOL, f"{arm}: parameters differ by {param_diff:.3e}"
    assert ref["moved"] > 100 * PARAM_TOL  # the tolerance is far below what a step changes
    return ok(results[0][key])


def test_nccl_tp_by_fsdp2_equals_single_process(nccl4: list[dict[str, Any]], single: dict[str, Any]) -> None:
    kinds = check(nccl4, "tp", single, "tp2-fsdp2-4")["kinds"]
    assert kinds["w1.weight"] == "native" and kinds["w2.weight"] == kinds["experts"] == "remap"
    assert sum(ok(r["tp"])["owned"] for r in nccl4) == 10


@pytest.mark.parametrize("key", ["ep", "ep_nofsdp"])
def test_nccl_ep_by_dp_equals_single_process(nccl4: list[dict[str, Any]], single: dict[str, Any], key: str) -> None:
    res = check(nccl4, key, single, "ep2-" + ("fsdp2-4" if key == "ep" else "nofsdp-4"))
    assert res["kinds"]["experts"] == ("native" if key == "ep" else "remap")
    assert sum(ok(r[key])["owned"] for r in nccl4) == 10


@pytest.mark.parametrize("key", ["tp", "ep"])
def test_nccl_tp_or_ep_checkpoint_resumes_in_one_process(nccl4: list[dict[str, Any]], ckpt: Path, key: str) -> None:
    run = ok(nccl4[0][key])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        path = str(ckpt) if key == "tp" else sc.ep_ckpt(str(ckpt))
        res = sc.run_resume(0, 1, "local", path, kw=sc.NCCL_KW)
    for i, entry in run["saved_state"].items():
        for k, v in entry.items():
            assert torch.equal(res["loaded_state"][i][k], v), (i, k)  # every entry exactly
    diff = max_diff(res["params"], run["params"])
    loss = max(abs(a - b) for a, b in zip(res["losses"], run["losses"][sc.CKPT_AT :]))
    record(f"dcp-{key}2-4to1", 1, diff, loss)
    assert diff <= PARAM_TOL and loss <= LOSS_TOL

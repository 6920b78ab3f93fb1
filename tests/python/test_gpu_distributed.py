"""The PyTorch front over NCCL, on this machine's GPUs, against one process on the same global
batch: FSDP2 (2, 4 ranks), HSDP 2 x 2, DDP and the gather baseline (2), CacheMuon (4), dedicate()
with and without overlap_step and gradient accumulation (2, 4; HSDP 2 x 2), bf16 autocast and
FSDP2's MixedPrecisionPolicy; a DCP checkpoint written at 4 ranks resumed at 2 and in one
process; 8 ranks when DISTMUON_TEST_RANKS includes 8. Skipped without a GPU, without distmuon's
CUDA backend, or where the ranks outnumber the GPUs and NCCL cannot share one (NCCL >= 2.30 with
NCCL_MULTI_RANK_GPU_ENABLE=1 can: tests/gpu/verify.sh runs it so on one GPU).

Tolerances (absolute, parameters of order 1 / losses). Float32 arms (Muon in float32): the ranks
sum gradients in another order than one process, as on gloo, and cuBLAS may pick other kernels
for other batch shapes: PARAM_TOL / LOSS_TOL, 10x the gloo suite's. Arms with bf16
Newton-Schulz (the CUDA default): a rounding flip of one bf16 input moves an update by up to
lr * 2^-8 of its size, over 10 steps: BF16_TOL. Arms with a bf16 forward (autocast,
MixedPrecisionPolicy): the gradients themselves differ by bf16 rounding, and MixedPrecisionPolicy
casts every parameter where autocast keeps norms in float32: MP_TOL / MP_LOSS_TOL. A broken mode
(a matrix not updated) differs by lr * steps * 0.25 ~ 0.05. Each arm's measured maximum goes to
DISTMUON_TEST_REPORT (a JSON file) for the GPU verification's summary.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dedicated_scenarios as ds
import dist_scenarios as sc
import gpu_dist_scenarios as gs
from dist_harness import launch, max_diff, ok
from distmuon.torch import Muon

PARAM_TOL = 5e-5
LOSS_TOL = 2e-5
BF16_TOL = 2e-3
MP_TOL = 1e-2
MP_LOSS_TOL = 5e-2


def _ranks_wanted() -> list[int]:
    return [int(x) for x in os.environ.get("DISTMUON_TEST_RANKS", "2,4").split(",")]


def _skip_reason() -> str | None:
    import distmuon

    if not torch.cuda.is_available():
        return "no CUDA device"
    if not distmuon.cuda_available():
        return "distmuon built without CUDA"
    if not torch.distributed.is_nccl_available():
        return "torch without NCCL"
    if max(_ranks_wanted()) > torch.cuda.device_count():
        version = _loaded_nccl_version()
        if version < 23000 or os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            return (
                f"{max(_ranks_wanted())} ranks on {torch.cuda.device_count()} GPU(s) need NCCL >= 2.30 "
                f"(the one loaded is {version}) and NCCL_MULTI_RANK_GPU_ENABLE=1"
            )
    return None


def _loaded_nccl_version() -> int:
    """The version of the NCCL this process runs (torch.cuda.nccl.version() is the one torch was
    built with; a newer one may be preloaded)."""
    import ctypes

    v = ctypes.c_int(0)
    try:
        ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(v))  # the copy already loaded
    except OSError:
        return 0
    return v.value


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

REPORT: dict[str, dict[str, Any]] = {}


def record(arm: str, ranks: int, param_diff: float, loss_diff: float) -> None:
    """An arm's largest differences, under the name of the test that checks it (as JUnit XML
    names it: the summary takes the verdict from there)."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].rsplit(" (", 1)[0]
    REPORT[arm] = {"ranks": ranks, "max_abs_diff": param_diff, "max_loss_diff": loss_diff, "test": test}


@pytest.fixture(scope="module", autouse=True)
def on_cuda() -> Iterator[None]:
    """The single-process references run on CUDA like the ranks; the report is written last."""
    old = os.environ.get("DISTMUON_TEST_DEVICE")
    os.environ["DISTMUON_TEST_DEVICE"] = "cuda"
    yield
    if old is None:
        del os.environ["DISTMUON_TEST_DEVICE"]
    else:
        os.environ["DISTMUON_TEST_DEVICE"] = old
    if path := os.environ.get("DISTMUON_TEST_REPORT"):
        Path(path).write_text(json.dumps(REPORT, indent=1))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp-nccl") / "step5"


@pytest.fixture(scope="module")
def nccl4(ckpt: Path) -> list[dict[str, Any]]:
    return launch(4, gs.world4, str(ckpt), backend="nccl", timeout_s=600)


@pytest.fixture(scope="module")
def nccl2(nccl4: list[dict[str, Any]], ckpt: Path) -> list[dict[str, Any]]:
    assert "error" not in nccl4[0]["fsdp"], nccl4[0]["fsdp"]  # the checkpoint exists
    return launch(2, gs.world2, str(ckpt), backend="nccl", timeout_s=600)


@pytest.fixture(scope="module")
def nccl8() -> list[dict[str, Any]]:
    if 8 not in _ranks_wanted():
        pytest.skip("DISTMUON_TEST_RANKS does not include 8")
    return launch(8, gs.world8, backend="nccl", timeout_s=600)


def _single(kw: dict[str, Any], amp: bool = False) -> dict[str, Any]:
    model = sc.make_model()
    opt = Muon(model, **kw)
    losses = sc.train(model, opt, range(sc.STEPS), 0, 1, amp)
    return {"losses": losses, "params": sc.full_params(model), "state": sc.full_state(opt), "stats": opt.stats()}


def _single_dedicated(kw: dict[str, Any], amp: bool = False) -> dict[str, Any]:
    model = ds.make_model()
    opt = Muon(model, **kw)
    losses = ds.train(model, opt, range(ds.STEPS), 0, 1, amp=amp)
    return {"losses": losses, "params": ds.full_model(model)}


@pytest.fixture(scope="module")
def single() -> dict[str, dict[str, Any]]:
    """One process on the whole global batch, per kind of arm."""
    return {
        "fp32": _single(gs.KW),
        "bf16": _single(sc.OPT_KW),
        "autocast": _single(sc.OPT_KW, amp=True),
        "cache": _single(gs.CACHE_KW),
        "ded_fp32": _single_dedicated(gs.DKW),
        "ded_autocast": _single_dedicated(ds.OPT_KW, amp=True),
    }


def check(
    results: list[dict[str, Any]], key: str, ref: dict[str, Any], tol: float, loss_tol: float, arm: str, mode: str | None
) -> None:
    param_diff = loss_diff = 0.0
    for r in results:
        res = ok(r[key])
        if mode is not None:
            assert res["mode"] == mode
        loss_diff = max(loss_diff, max(abs(a - b) for a, b in zip(res["losses"], ref["losses"])))
        param_diff = max(param_diff, max_diff(res["params"], ref["params"]))
    record(arm, len(results), param_diff, loss_diff)
    assert loss_diff <= loss_tol, f"{arm}: losses differ by {loss_diff:.3e}"
    assert param_diff <= tol, f"{arm}: parameters differ by {param_diff:.3e}"
    assert ref["losses"][-1] < ref["losses"][0]  # it trains


# ---- FSDP2, HSDP, DDP, gather --------------------------------------------------------------------


@pytest.mark.parametrize("launch_size, key, mode", [(2, "fsdp", "sharded"), (4, "fsdp", "sharded"), (4, "hsdp", "sharded"), (2, "ddp", "replicated"), (2, "gather", "gather")])
def test_nccl_equals_single_process(nccl2: list, nccl4: list, single: dict, launch_size: int, key: str, mode: str) -> None:
    results = nccl2 if launch_size == 2 else nccl4
    name = {"fsdp": "fsdp2", "hsdp": "hsdp", "ddp": "ddp", "gather": "gather"}[key]
    check(results, key, single["fp32"], PARAM_TOL, LOSS_TOL, f"{name}-{launch_size}", mode)


def test_nccl_owners_split_the_matrices(nccl2: list) -> None:
    owned = [ok(r["fsdp"])["owned"] for r in nccl2]
    assert sum(owned) == 7 and all(o > 0 for o in owned)


def test_nccl_cache_muon_equals_single_process(nccl4: list, single: dict) -> None:
    check(nccl4, "fsdp_cache", single["cache"], PARAM_TOL, LOSS_TOL, "cache-fsdp2-4", "sharded")
    assert sum(ok(r["fsdp_cache"])["stats"]["cache_hits"] for r in nccl4) == single["cache"]["stats"]["cache_hits"] > 0


def test_nccl_bf16_newton_schulz_close_to_single_process(nccl4: list, single: dict) -> None:
    check(nccl4, "fsdp_bf16", single["bf16"], BF16_TOL, 10 * LOSS_TOL, "fsdp2-bf16ns-4", "sharded")


@pytest.mark.parametrize("key", ["fsdp_autocast", "fsdp_mp"])
def test_nccl_mixed_precision_close_to_single_process_autocast(nccl4: list, single: dict, key: str) -> None:
    check(nccl4, key, single["autocast"], MP_TOL, MP_LOSS_TOL, key.replace("fsdp", "fsdp2") + "-4", "sharded")


def test_nccl_eight_ranks(nccl8: list, single: dict) -> None:
    for key, name in (("fsdp", "fsdp2"), ("hsdp", "hsdp")):
        check(nccl8, key, single["fp32"], PARAM_TOL, LOSS_TOL, f"{name}-8", "sharded")
    check(nccl8, "ded_flat", single["ded_fp32"], PARAM_TOL, LOSS_TOL, "dedicated-8", None)


# ---- dedicate() ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "launch_size, key",
    [(2, "ded_plain"), (2, "ded_overlap"), (2, "ded_accum_overlap"), (4, "ded_flat"), (4, "ded_hsdp"), (4, "ded_accum")],
)
def test_nccl_dedicated_equals_single_process(nccl2: list, nccl4: list, single: dict, launch_size: int, key: str) -> None:
    results = nccl2 if launch_size == 2 else nccl4
    check(results, key, single["ded_fp32"], PARAM_TOL, LOSS_TOL, f"dedicated-{key[4:]}-{launch_size}", None)
    for r in results:
        assert ok(r[key])["mode"] == "dedicated"
        assert ok(r[key])["dedicated_grads_dropped"]


def test_nccl_dedicated_with_autocast(nccl4: list, single: dict) -> None:
    check(nccl4, "ded_autocast", single["ded_autocast"], MP_TOL, MP_LOSS_TOL, "dedicated-autocast-4", None)


# ---- DCP: written at 4 ranks, resumed at 2 and at 1 ------------------------------------------


def test_nccl_checkpoint_of_four_ranks_resumes_at_two(nccl2: list, nccl4: list) -> None:
    run = ok(nccl4[0]["fsdp"])
    diff = loss = 0.0
    for r in nccl2:
        res = ok(r["resume2"])
        for i, entry in run["saved_state"].items():
            for k, v in entry.items():
                assert torch.equal(res["loaded_state"][i][k], v), (i, k)  # every entry exactly
        diff = max(diff, max_diff(res["params"], run["params"]))
        loss = max(loss, max(abs(a - b) for a, b in zip(res["losses"], run["losses"][sc.CKPT_AT :])))
    record("dcp-4to2", 2, diff, loss)
    assert diff <= PARAM_TOL and loss <= LOSS_TOL


def test_nccl_checkpoint_of_four_ranks_resumes_in_one_process(nccl4: list, ckpt: Path) -> None:
    import torch.distributed.checkpoint as dcp

    run = ok(nccl4[0]["fsdp"])
    model = sc.make_model()
    opt = Muon(model, **gs.KW)
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
    diff = max_diff(sc.full_params(model), run["params"])
    loss = max(abs(a - b) for a, b in zip(losses, run["losses"][sc.CKPT_AT :]))
    record("dcp-4to1", 1, diff, loss)
    assert diff <= PARAM_TOL and loss <= LOSS_TOL

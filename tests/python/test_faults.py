"""Faults on CPU ranks (gloo): a peer that stalls before step(), a peer killed with SIGKILL in
the middle of a step or of a DCP checkpoint.

- A stalled peer: the other rank raises within DISTMUON_COMM_TIMEOUT_S plus SLACK_S, naming
  the collective, the ranks and the variable, with no Python traceback inside (it used to take
  twice the timeout and embed two tracebacks). CI runs it at TIMEOUTS_S; setting
  DISTMUON_TEST_TIMEOUTS="10,20" measures the figures the documentation quotes.
- A killed peer: the other rank raises at once (gloo sees the closed connection), well within
  the timeout; in a checkpoint, the interrupted one is refused and the last complete one loads
  and continues bit-exactly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import fault_scenarios as fs
from dist_harness import max_diff
from fault_harness import launch

# The slack above the timeout that the error may take: the wait itself ends at the timeout; the
# rest is the error's way out of the engine and the Python front (measured: < 0.1 s).
SLACK_S = 2.0
TIMEOUTS_S = [float(t) for t in os.environ.get("DISTMUON_TEST_TIMEOUTS", "3").split(",")]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")


def survivor(ranks: list[dict[str, Any] | None]) -> dict[str, Any]:
    r0 = ranks[0]
    assert r0 is not None, "rank 0 reported nothing"
    assert "error" not in r0, r0.get("traceback", r0.get("error"))
    return r0


@pytest.mark.parametrize("timeout_s", TIMEOUTS_S)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_stalled_peer_gives_an_error_within_the_timeout(kind: str, timeout_s: float) -> None:
    res = survivor(launch(2, fs.stall_before_step, kind, report_from=[0], comm_timeout_s=timeout_s))
    print(f"[measure] {kind}, DISTMUON_COMM_TIMEOUT_S={timeout_s:g}: error after {res['elapsed']:.3f} s")
    assert res["raised"] == "TimeoutError", res
    # Not before the timeout, within 1 ms: the engine's clock and this test's are read in
    # different places (seen 2.99996 s at 3 s once).
    assert timeout_s - 1e-3 <= res["elapsed"] < timeout_s + SLACK_S
    msg = res["message"]
    assert "all_reduce on torch-gloo" in msg  # the collective and its communicator
    assert "rank 0 of 2, world ranks 0,1" in msg  # who waited, among which members
    assert f"did not complete within {timeout_s:g} s" in msg and "DISTMUON_COMM_TIMEOUT_S" in msg
    assert "Traceback" not in msg and "\n" not in msg


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_peer_killed_mid_step_gives_an_error_at_once(kind: str) -> None:
    ranks = launch(2, fs.kill_mid_step, kind, report_from=[0, 1], comm_timeout_s=30)
    assert ranks[1] is None  # killed
    res = survivor(ranks)
    print(f"[measure] {kind}, peer killed mid-step: error after {res['elapsed']:.3f} s")
    assert res["raised"] is not None, res
    assert res["elapsed"] < 30
    assert "on torch-gloo" in res["message"] and "Traceback" not in res["message"]


def test_a_peer_killed_mid_checkpoint_leaves_the_last_checkpoint_whole(tmp_path: Path) -> None:
    root = str(tmp_path)
    ranks = launch(2, fs.kill_mid_checkpoint, root, report_from=[0, 1], comm_timeout_s=30)
    assert ranks[1] is None  # killed
    res = survivor(ranks)
    print(f"[measure] peer killed while a DCP checkpoint is written: error after {res['elapsed']:.3f} s")
    assert res["raised"] is not None, res
    assert res["elapsed"] < 30

    resumed = launch(2, fs.resume_after_the_fault, root, report_from=[0, 1])
    for r in resumed:
        assert r is not None and "error" not in r, r and r.get("traceback")
        assert not r["partial_loaded"], "the interrupted checkpoint loaded"
        assert r["losses"] == r["ref_losses"]
        assert max_diff(r["params"], r["ref_params"]) == 0.0
        for i, st in r["state"].items():
            for k, v in st.items():
                assert torch.equal(v, r["ref_state"][i][k]), (i, k)

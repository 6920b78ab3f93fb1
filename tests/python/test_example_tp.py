"""examples/train_tp.py as a user runs it: TP 2 x FSDP 2 and an MoE block at EP 2 x FSDP 2 (4 gloo
ranks each) train and, with --check, end within float32 reduction order of one process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_tp.py"
TINY = ["--steps", "4", "--layers", "1", "--dim", "32", "--hidden", "48", "--seq", "16", "--check"]

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")


@pytest.mark.parametrize("layout", [["--tp", "2", "--dp", "2"], ["--ep", "2", "--dp", "2"]])
def test_the_example_equals_one_process(layout: list[str]) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), *layout, *TINY], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "optimizer: sharded over 4 ranks" in r.stdout
    diff = float(re.search(r"largest parameter difference from one process: (\S+)", r.stdout).group(1))  # type: ignore[union-attr]
    assert diff < 1e-5, r.stdout


def test_bad_arguments_are_refused() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--tp", "2", "--ep", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tp or --ep, not both" in r.stderr

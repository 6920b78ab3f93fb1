"""distmuon and torch import in either order (tests/gpu/import_order.sh, which the GPU machine
also runs on its own): in a CUDA build the extension's CUDA libraries must be the files torch
loads, else the later import fails on a symbol only torch's NCCL has."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "gpu" / "import_order.sh"


def test_either_import_order_works_and_loads_one_copy_of_each_library() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and not any(line.startswith("FAIL") for line in lines), run.stdout + run.stderr
    # every check reports, and the import checks ran rather than skipped
    assert len(lines) == 9, run.stdout
    assert all(line.startswith("PASS") for line in lines[:4]), run.stdout


def test_libraries_are_found_in_nvidia_wheels_in_search_order(tmp_path: Path) -> None:
    from distmuon import _cuda_libs

    first, second = tmp_path / "torch_site", tmp_path / "other_site"
    for site, sub in ((first, "cu13"), (second, "nccl")):
        (site / "nvidia" / sub / "lib").mkdir(parents=True)
        (site / "nvidia" / sub / "lib" / "libnccl.so.2").write_bytes(b"")
    assert _cuda_libs.find("libnccl.so.2", [str(first), str(second)]) == str(first / "nvidia/cu13/lib/libnccl.so.2")
    assert _cuda_libs.find("libnccl.so.2", [str(second), str(first)]) == str(second / "nvidia/nccl/lib/libnccl.so.2")
    assert _cuda_libs.find("libcublas.so.13", [str(first), str(second)]) is None

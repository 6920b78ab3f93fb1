"""Loads the CUDA libraries of a CUDA build of ``distmuon._C`` from the files torch uses.

``_C`` links the CUDA runtime, cuBLAS, cuBLASLt and NCCL by soname (``libnccl.so.2``, ...), and
every library that names a soname binds to the first library of that soname the process loaded:
whichever import comes first fixes it for the others. torch's wheels bring their own copies (the
``nvidia-*`` wheels, reached through RPATHs such as ``$ORIGIN/../../nvidia/nccl/lib``), while a
CUDA toolkit puts other, often older, copies on the loader's default path. If ``_C`` were loaded
first it would take the toolkit's, and torch would then fail to load (``libtorch_cuda.so:
undefined symbol: ncclCommResume``). So before ``_C`` is imported, each library it links is
loaded by path from the ``nvidia-*`` wheel folders, searched as torch searches them (beside
torch first, then ``sys.path``), unless the process already holds one (torch imported first, or
an ``LD_PRELOAD``ed NCCL, which is then what everybody binds to); a library found in no wheel is
left to the loader (a toolkit or system install), which is what torch then uses too.

``CUDA_LIBRARIES`` (the sonames ``_C`` links; empty in a CPU-only build) is written into
``_build_config.py`` by python/CMakeLists.txt.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import sys

from distmuon._build_config import CUDA_LIBRARIES


def wheel_dirs() -> list[str]:
    """site-packages folders to search for ``nvidia/<package>/lib``, torch's own first."""
    dirs = []
    spec = importlib.util.find_spec("torch")  # locates torch without importing it
    if spec is not None and spec.origin:
        dirs.append(os.path.dirname(os.path.dirname(spec.origin)))
    dirs += [p for p in sys.path if p and os.path.isdir(p)]
    return list(dict.fromkeys(dirs))


def find(soname: str, dirs: list[str]) -> str | None:
    for d in dirs:
        hits = sorted(glob.glob(os.path.join(d, "nvidia", "*", "lib", soname)))
        if hits:
            return hits[0]
    return None


def loaded(soname: str) -> bool:
    """Whether the process already holds a library of that soname (torch imported first, or
    LD_PRELOAD): that copy is the one every later user gets, so it is kept."""
    try:
        ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
        return True
    except OSError:
        return False


def load() -> dict[str, str | None]:
    """Loads every library of CUDA_LIBRARIES not yet in the process from a wheel; returns
    soname -> the path loaded here (None: already loaded, or left to the loader)."""
    dirs = wheel_dirs() if CUDA_LIBRARIES else []
    found: dict[str, str | None] = {}
    for soname in CUDA_LIBRARIES:  # in dependency order: the runtime, cuBLASLt before cuBLAS
        path = None if loaded(soname) else find(soname, dirs)
        if path is not None:
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        found[soname] = path
    return found

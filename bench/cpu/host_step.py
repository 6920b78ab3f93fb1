#!/usr/bin/env python3
"""The host cost of distmuon.torch's distributed steps on CPU ranks (gloo), and how often control
crosses between Python and C++ in them: a small GPT (examples/train_gpt.py), every rank on one
torch thread, fixed batches.

    python3 bench/cpu/host_step.py                       # 2 ranks, 3 runs, every configuration
    python3 bench/cpu/host_step.py --runs 1 --steps 10   # a quick look
    python3 bench/cpu/host_step.py --configs dedicated --json out/host_step.json
    python3 bench/cpu/host_step.py --pythons before=venv-a/bin/python,after=venv-b/bin/python
                                                         # two builds, their runs alternating

Configurations (each on fresh processes, every rank the same):

    dedicated          dedicate(Muon matrices) + fully_shard of the rest + Muon (overlap_step off,
                       the CPU's default): the dedicated reductions run in backward's hooks and at
                       step(); timed: backward and opt.step()
    dedicated-overlap  the same with overlap_step on (owners start each layer's update in backward)
    fsdp               fully_shard + Muon (sharded mode); timed: opt.step()
    ddp                DistributedDataParallel + Muon (replicated mode); timed: opt.step()

Per configuration and rank, the median over --steps timed steps (after --warmup) of the phases
in milliseconds (ranks start each phase together: a barrier before it), wall time and the CPU
time of the rank's own thread (`cpu`: the host's work, without waiting for the other ranks or for
the collectives' threads), the part of that CPU time spent in the dedicated runtime (its hooks
and the optimizer's calls before and after its step: Python, the C++ stages, their callbacks),
and per step (forward, backward and step()) the crossings counted
by wrapping the front's classes: callbacks from C++ into Python (the torch communicator's
collectives `comm`, its completion polls and waits `poll`, the dedicated memory's requests
`memory`: MEMORY_CALLBACKS) and the calls of the dedicated hooks into C++ (`hook->C++`). A
figure is the slowest rank's; the summary line is the median over --runs runs.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("dedicated", "dedicated-overlap", "fsdp", "ddp")
# Wall milliseconds, and the CPU milliseconds of the rank's own thread (what the host spends on
# it, without waiting for the other ranks or the collectives' threads).
PHASES = ("forward", "backward", "step", "backward_cpu", "step_cpu", "runtime_cpu")
# The dedicated memory's methods that the C++ transfers call (DedicatedMemory; the front calls
# the others itself).
MEMORY_CALLBACKS = frozenset({"bucket", "release_bucket", "grads", "drop_grad", "has_grad"})


# ---- counting the crossings ------------------------------------------------------------------


_DEPTH: Counter = Counter()  # per kind: calls of that kind in progress


def _counting(
    cls: type, kind: str, counts: Counter, names: frozenset[str] | None = None, by_method: bool = False
) -> None:
    """Counts every call of cls's public methods (or of `names`: those C++ calls back) under
    `kind` (`kind.method` with by_method), except those made inside another of the same kind (a
    batch's operations)."""
    for name, fn in list(vars(cls).items()):
        if name.startswith("_") or not callable(fn) or (names is not None and name not in names):
            continue
        key = f"{kind}.{name}" if by_method else kind

        def wrapped(*a: Any, __fn: Any = fn, __key: str = key, **k: Any) -> Any:
            if _DEPTH[kind] == 0:
                counts[__key] += 1
            _DEPTH[kind] += 1
            try:
                return __fn(*a, **k)
            finally:
                _DEPTH[kind] -= 1

        setattr(cls, name, functools.wraps(fn)(wrapped))


class _CountingProxy:
    """Stands for a C++ object (the dedicated transfers): counts the calls made on it."""

    def __init__(self, target: Any, kind: str, counts: Counter) -> None:
        self._target, self._kind, self._counts = target, kind, counts

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr):
            return attr

        def call(*a: Any, **k: Any) -> Any:
            self._counts[self._kind] += 1
            return attr(*a, **k)

        return call


# The dedicated runtime's entry points from PyTorch (its hooks, and the optimizer's calls around
# the step): methods, and factories of the hooks they install.
RUNTIME_METHODS = ("_begin_forward", "before_step", "after_step")
RUNTIME_FACTORIES = ("_before_unit", "_after_unit", "_grad_hook")


def _timed(fn: Any, spent: list[float]) -> Any:
    @functools.wraps(fn)
    def wrapped(*a: Any, **k: Any) -> Any:
        t = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            spent[0] += time.thread_time() - t

    return wrapped


def time_runtime(spent: list[float]) -> None:
    """Adds the CPU time of this thread inside the dedicated runtime's hooks and step entries
    (Python and the C++ they call, with its callbacks) to spent[0]."""
    from distmuon.torch.dedicate import Dedicated

    for name in RUNTIME_METHODS:
        setattr(Dedicated, name, _timed(getattr(Dedicated, name), spent))
    for name in RUNTIME_FACTORIES:
        factory = getattr(Dedicated, name)

        def make(self: Any, *a: Any, __factory: Any = factory) -> Any:
            return _timed(__factory(self, *a), spent)

        setattr(Dedicated, name, functools.wraps(factory)(make))


def instrument(counts: Counter, by_method: bool) -> None:
    """Wraps the front's callback classes (whichever of them this version has)."""
    from distmuon.torch import _torch_comm

    _counting(_torch_comm.TorchCollectives, "comm", counts, by_method=by_method)
    for name in ("Pending", "Batch"):  # a batch's polls reach its operations' within one crossing
        if hasattr(_torch_comm, name):
            _counting(getattr(_torch_comm, name), "poll", counts, by_method=by_method)
    try:
        from distmuon.torch import _dedicated_layout

        if hasattr(_dedicated_layout, "Memory"):
            _counting(_dedicated_layout.Memory, "memory", counts, MEMORY_CALLBACKS, by_method)
    except ImportError:
        pass


# ---- one rank --------------------------------------------------------------------------------


def _build(kind: str, cfg: Any, world: int, counts: Counter) -> tuple[Any, Any, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from train_gpt import GPT

    from distmuon.torch import Muon, dedicate

    torch.manual_seed(0)
    model = GPT(cfg)
    dm = None
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        opt = Muon(model, lr=0.02, adamw_lr=3e-3)  # replicated: the plain parameters
        model = DistributedDataParallel(model)
        return model, None, opt
    mesh = init_device_mesh("cpu", (world,))
    ignored: set[Any] = set()
    if kind.startswith("dedicated"):
        dm = dedicate(model, mesh, overlap_step=kind == "dedicated-overlap")
        dm.transfers = _CountingProxy(dm.transfers, "hook->C++", counts)
        ignored = dm.ignored_params
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    return model, dm, Muon(model, lr=0.02, adamw_lr=3e-3)


def rank_main(rank: int, world: int, port: int, out: str, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import torch.distributed as dist
    from train_gpt import GPTConfig

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    counts: Counter = Counter()
    instrument(counts, args.by_method)
    spent = [0.0]
    time_runtime(spent)
    cfg = GPTConfig(vocab=65, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    gen = torch.Generator().manual_seed(rank)
    batches = []
    for _ in range(4):
        idx = torch.randint(0, cfg.vocab, (args.batch, cfg.block_size + 1), generator=gen)
        batches.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    result: dict[str, Any] = {}
    for kind in args.configs:
        model, dm, opt = _build(kind, cfg, world, counts)
        phases: dict[str, list[float]] = {k: [] for k in PHASES}
        crossings: Counter = Counter()
        for i in range(args.warmup + args.steps):
            x, y = batches[i % len(batches)]
            opt.zero_grad()
            dist.barrier()
            before, runtime = Counter(counts), spent[0]
            t0 = time.perf_counter()
            loss = model(x, y)
            t1 = time.perf_counter()
            dist.barrier()
            t2, c2 = time.perf_counter(), time.thread_time()
            loss.backward()
            t3, c3 = time.perf_counter(), time.thread_time()
            dist.barrier()
            t4, c4 = time.perf_counter(), time.thread_time()
            opt.step()
            t5, c5 = time.perf_counter(), time.thread_time()
            if i >= args.warmup:
                phases["forward"].append((t1 - t0) * 1e3)
                phases["backward"].append((t3 - t2) * 1e3)
                phases["step"].append((t5 - t4) * 1e3)
                phases["backward_cpu"].append((c3 - c2) * 1e3)
                phases["step_cpu"].append((c5 - c4) * 1e3)
                phases["runtime_cpu"].append((spent[0] - runtime) * 1e3)
                crossings.update(Counter(counts) - before)
        row = {k: statistics.median(v) for k, v in phases.items()}
        row["crossings_per_step"] = {k: v / args.steps for k, v in sorted(crossings.items())}
        row["mode"] = opt.dist_mode
        result[kind] = row
        del model, dm, opt
        gc.collect()
        dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


# ---- the launcher ----------------------------------------------------------------------------


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration on fresh ranks; per configuration the slowest rank's figures."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(rank_main, args=(args.ranks, port, out, args), nprocs=args.ranks, start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    merged: dict[str, Any] = {}
    for kind in args.configs:
        rows = [r[kind] for r in ranks]
        merged[kind] = {k: max(r[k] for r in rows) for k in PHASES}
        merged[kind]["mode"] = rows[0]["mode"]
        names = sorted({n for r in rows for n in r["crossings_per_step"]})
        merged[kind]["crossings_per_step"] = {n: max(r["crossings_per_step"].get(n, 0) for r in rows) for n in names}
    return merged


def summarize(label: str, runs: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    """The median over runs of each figure, printed one line per configuration."""
    summary: dict[str, Any] = {}
    for kind in configs:
        rows = [run[kind] for run in runs]
        med = {k: statistics.median(r[k] for r in rows) for k in PHASES}
        summary[kind] = dict(med, mode=rows[0]["mode"], crossings_per_step=rows[-1]["crossings_per_step"])
        cross = " ".join(f"{k} {v:g}" for k, v in rows[-1]["crossings_per_step"].items())
        runtime = f"  dedicated runtime cpu {med['runtime_cpu']:6.3f}" if kind.startswith("dedicated") else ""
        print(
            f"  {label}{kind:>17} ({rows[0]['mode']}): backward {med['backward']:7.3f} (cpu {med['backward_cpu']:7.3f})  "
            f"step {med['step']:7.3f} (cpu {med['step_cpu']:7.3f}){runtime}   crossings/step: {cross or '-'}"
        )
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="fresh launches; the summary is their median")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4, help="per rank")
    ap.add_argument(
        "--pythons",
        default="",
        help="LABEL=PYTHON,...: interpreters (each with its own distmuon) whose runs alternate, run after run, "
        "so that a drifting machine falls on each alike; default: this one alone",
    )
    ap.add_argument("--by-method", action="store_true", help="crossings per method rather than per kind")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    for c in args.configs:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c!r} (one of {', '.join(CONFIGS)})")
    pythons = [tuple(x.split("=", 1)) for x in args.pythons.split(",") if x] or [("", "")]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in pythons}
    for r in range(args.runs):
        for label, python in pythons:
            if python:
                runs[label].append(_run_in(python, args))
            else:
                runs[label].append(one_run(args))
            for kind, row in runs[label][-1].items():
                print(
                    f"run {r + 1} {label}{' ' if label else ''}{kind:>17}: backward {row['backward']:7.3f} "
                    f"(cpu {row['backward_cpu']:7.3f})  step {row['step']:7.3f} (cpu {row['step_cpu']:7.3f})  "
                    f"dedicated runtime cpu {row['runtime_cpu']:6.3f} ms",
                    flush=True,
                )
    print(f"median of {args.runs} runs ({args.ranks} gloo ranks, {args.threads} torch thread(s) each, ms; slowest rank):")
    medians = {label: summarize(f"{label} " if label else "", runs[label], args.configs) for label, _ in pythons}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        keep = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"args": keep, "runs": runs, "median": medians}, indent=2))
    return 0


def _run_in(python: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of this script under another interpreter."""
    import subprocess

    with tempfile.TemporaryDirectory() as out:
        path = Path(out, "run.json")
        cmd = [python, __file__, "--runs", "1", "--json", str(path), "--configs", ",".join(args.configs)]
        cmd += ["--by-method"] if args.by_method else []
        for k in ("ranks", "steps", "warmup", "threads", "layers", "embd", "heads", "block", "batch"):
            cmd += [f"--{k}", str(getattr(args, k))]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(path.read_text())["runs"][""][0]


if __name__ == "__main__":
    sys.exit(main())

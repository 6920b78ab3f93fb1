"""Shared pieces of the training-quality studies: optimizer arms, timing, and result records.

An arm is a string such as "adamw:lr=6e-4", "torch-muon", "distmuon:algo=ns5",
"distmuon:algo=gram-ns:gamma=2" (CacheMuon, residual trigger), "...:gamma=15:probes=8" (the
residual estimated with 8 Gaussian probes) or "...:gamma=1e6:staleness=3" (a staleness
schedule: the residual never refuses, every entry is refreshed after 3 reuses) or
"...:gamma=2:backoff=8" (the check back-off: an entry that keeps failing its test is tested
after 1, 2, 4, 8 misses, then every 8th step) or "...:gamma=2:gate=batch" (a call hits only if
every matrix of its batch passes, else all refresh). Every arm of a
study starts from the same initial weights and sees the same batches in the same order, so the
curves differ only by the optimizer.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, asdict
from typing import Callable

import torch


RESIDUAL_OFF = 1e6  # a cache_gamma at or above this never refuses a reuse (the residuals seen: 10-30)


@dataclass
class Arm:
    kind: str  # "adamw" | "torch-muon" | "distmuon"
    lr: float | None = None
    algo: str = "ns5"
    gamma: float | None = None
    probes: int | None = None  # CacheMuon residual from k Gaussian probes (None: exact)
    staleness: int = 0  # CacheMuon: refresh an entry after this many reuses (0: no limit)
    backoff: int = 0  # CacheMuon: longest interval between tests of a failing entry (0: none)
    gate: str = "matrix"  # CacheMuon: "matrix" (each decides alone) or "batch" (all or nothing)
    shadow: bool = False  # CacheMuon also runs the fresh solve, to measure the cached updates' alignment

    @property
    def label(self) -> str:
        if self.kind == "adamw":
            return f"adamw(lr={self.lr:g})"
        if self.kind == "torch-muon":
            return "torch.optim.Muon"
        s = f"distmuon {self.algo}"
        if self.gamma is not None:
            # A gamma no residual reaches leaves the staleness schedule as the only trigger.
            s += " cache" + (f" γ={self.gamma:g}" if self.gamma < RESIDUAL_OFF else "")
            s += f" probes={self.probes}" if self.probes else ""
            s += f" staleness={self.staleness}" if self.staleness else ""
            s += f" backoff={self.backoff}" if self.backoff else ""
            s += " gate=batch" if self.gate == "batch" else ""
        return s + (" (shadow)" if self.shadow else "")


def parse_arm(spec: str) -> Arm:
    parts = spec.split(":")
    arm = Arm(kind=parts[0])
    if arm.kind not in ("adamw", "torch-muon", "distmuon"):
        raise ValueError(f"unknown arm '{spec}' (adamw, torch-muon or distmuon)")
    rest = parts[1:]
    # "algo=gram-ns" may itself contain ':' (coefficients), so rejoin non key=value pieces.
    for item in rest:
        if "=" not in item:
            arm.algo += ":" + item
            continue
        key, value = item.split("=", 1)
        if key == "lr":
            arm.lr = float(value)
        elif key == "algo":
            arm.algo = value
        elif key == "gamma":
            arm.gamma = float(value)
        elif key == "probes":
            arm.probes = int(value)
        elif key == "staleness":
            arm.staleness = int(value)
        elif key == "backoff":
            arm.backoff = int(value)
        elif key == "gate":
            arm.gate = value
        elif key == "shadow":
            arm.shadow = value not in ("0", "false", "no")
        else:
            raise ValueError(f"unknown key '{key}' in arm '{spec}'")
    if arm.probes is not None and arm.probes < 1 or arm.staleness < 0 or arm.backoff < 0:
        raise ValueError(f"arm '{spec}': probes must be >= 1, staleness and backoff >= 0")
    if arm.gate not in ("matrix", "batch"):
        raise ValueError(f"arm '{spec}': gate must be 'matrix' or 'batch'")
    if (arm.probes or arm.staleness or arm.backoff or arm.shadow or arm.gate != "matrix") \
            and arm.gamma is None:
        raise ValueError(f"arm '{spec}': probes, staleness, backoff, gate and shadow are CacheMuon "
                         "options (give gamma)")
    return arm


def is_muon_param(name: str, p: torch.nn.Parameter) -> bool:
    """Muon for hidden matrices; AdamW for embeddings, the output head, norms and biases."""
    if p.ndim < 2:
        return False
    lowered = name.lower()
    return not any(k in lowered for k in ("embed", "wte", "wpe", "lm_head", "head", "fc_out"))


def make_optimizer(arm: Arm, model: torch.nn.Module, muon_lr: float, adamw_lr: float,
                   weight_decay: float) -> torch.optim.Optimizer | list[torch.optim.Optimizer]:
    named = list(model.named_parameters())
    if arm.kind == "adamw":
        lr = arm.lr if arm.lr is not None else adamw_lr
        fused = next(model.parameters()).is_cuda
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                                 betas=(0.9, 0.95), fused=fused)
    if arm.kind == "torch-muon":
        muon = [p for n, p in named if is_muon_param(n, p)]
        rest = [p for n, p in named if not is_muon_param(n, p)]
        fused = next(model.parameters()).is_cuda
        return [torch.optim.Muon(muon, lr=muon_lr, weight_decay=weight_decay, momentum=0.95,
                                 nesterov=True, adjust_lr_fn="original"),
                torch.optim.AdamW(rest, lr=adamw_lr, weight_decay=weight_decay,
                                  betas=(0.9, 0.95), fused=fused)]
    from distmuon.torch import Muon  # imported here: the other arms must run without it

    return Muon(named, lr=muon_lr, momentum=0.95, nesterov=True, weight_decay=weight_decay,
                adjust_lr_fn="original", algorithm=arm.algo, cache_gamma=arm.gamma, cache_probes=arm.probes,
                cache_max_staleness=arm.staleness, cache_check_backoff=arm.backoff,
                cache_shadow=arm.shadow, cache_gate=arm.gate,
                adamw_lr=adamw_lr, adamw_betas=(0.9, 0.95), adamw_weight_decay=weight_decay,
                muon_filter=lambda n, p: is_muon_param(n, p))


def step_all(opt) -> None:
    for o in opt if isinstance(opt, list) else [opt]:
        o.step()


def zero_all(opt) -> None:
    for o in opt if isinstance(opt, list) else [opt]:
        o.zero_grad(set_to_none=True)


def batch_plan(n_tokens: int, context: int, batch: int, steps: int, seed: int) -> tuple[torch.Tensor, float]:
    """The start of every training window of every step, (steps, batch), from the seed alone (so
    every arm of a seed trains on the same batches), and how many epochs that is.

    Each epoch cuts the corpus into non-overlapping windows of `context` tokens (an offset drawn
    per epoch moves their boundaries) and visits them in a random order, so within an epoch no
    token is a target twice: the number of epochs, not the number of steps, is what a model can
    memorise."""
    gen = torch.Generator().manual_seed(seed)
    epochs, need = [], steps * batch
    per_epoch = (n_tokens - 1 - (context - 1)) // context  # windows that fit at any offset
    if per_epoch < batch:
        raise ValueError(f"{n_tokens} tokens hold {per_epoch} windows of {context}: fewer than a batch of {batch}")
    while need > 0:
        offset = int(torch.randint(0, context, (1,), generator=gen))
        starts = offset + context * torch.randperm(per_epoch, generator=gen)
        epochs.append(starts[:need])
        need -= len(epochs[-1])
    return torch.cat(epochs).view(steps, batch), steps * batch / per_epoch


def tensor_digest(tensors) -> str:
    """SHA-256 of the tensors' bytes, in order: equal digests, equal inputs."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def ns5_flops(rows: int, cols: int, steps: int = 5) -> float:
    """FLOPs of dense quintic Newton-Schulz (torch.optim.Muon): 2T(2a+1)m^3."""
    m, n = min(rows, cols), max(rows, cols)
    return 2.0 * steps * (2.0 * n / m + 1.0) * m ** 3


def record_cache(res: "ArmResult", st: dict) -> None:
    """The latest step's CacheMuon figures; the alignment only on steps that reused a transform
    (with no hit it reads 1 and says nothing)."""
    hit = st.get("last_hit_rate")
    res.hit_rate.append(hit)
    res.residual.append(st.get("last_mean_residual"))
    res.align.append(st.get("last_alignment") if hit else None)


def cache_stats(opt) -> dict | None:
    """The distmuon optimizer's orthogonalization counters, or None for other optimizers."""
    stats = getattr(opt, "stats", None)
    return stats() if callable(stats) else None


class Timer:
    """Device-accurate wall time of a region (CUDA events on GPU, perf_counter on CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            self.ms = self.start.elapsed_time(self.end)
        else:
            self.ms = (time.perf_counter() - self.t0) * 1e3


@dataclass
class ArmResult:
    arm: str
    label: str
    seed: int = 0
    init_digest: str = ""   # of the initial weights: equal for every arm of a seed
    batch_digest: str = ""  # of every training batch fed, in order: equal for every arm of a seed
    steps: list[int] = field(default_factory=list)
    val: list[float] = field(default_factory=list)        # loss (LM) or accuracy (vision)
    train_loss: list[float] = field(default_factory=list)
    opt_ms: list[float] = field(default_factory=list)     # per step
    ortho_flops: list[float] = field(default_factory=list)  # per step
    hit_rate: list[float | None] = field(default_factory=list)  # per step (cache arms)
    residual: list[float | None] = field(default_factory=list)
    align: list[float | None] = field(default_factory=list)  # cos(cached, fresh) when probed
    final: float = math.nan
    wall_s: float = 0.0     # the training loop, evaluations included
    setup_s: float = 0.0    # model, optimizer and batch plan before it
    device: str = ""        # where it ran (a study merged from several device calls may mix them)


def save_results(path: str, meta: dict, results: list[ArmResult]) -> None:
    """Written after every arm (a run cut short keeps what it finished), with the command line."""
    command = meta.get("command") or "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    meta = dict(meta, command=command,
                device_name=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                torch=torch.__version__)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "arms": [asdict(r) for r in results]}, f, indent=1)

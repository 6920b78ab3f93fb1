"""Test helpers: small models, a training loop that drives any set of optimizers (in one process
or on the ranks of a distributed scenario), what the distributed scenarios return (whole tensors,
DCP checkpoints), and torch.optim.Muon's Newton-Schulz in float32 (torch always iterates in
bfloat16)."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn


def newton_schulz_fp32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """torch.optim.Muon's iteration (same normalisation and orientation) in float32."""
    a, b, c = ns_coefficients
    x = grad.to(torch.float32, copy=True)
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


def write_cost_store(path: str, points: dict[tuple[int, int], list[tuple[int, float]]]) -> None:
    """A measurement store as `distmuon-plan --measure` writes it, with one table: seconds per
    batch size of each (rows, cols) on this machine's CPU backend as the front runs it (its BLAS
    thread count is part of the name), for the front's default algorithm and CPU iteration dtype:
    the key the engine looks up."""
    from distmuon import _C
    from distmuon.torch._device import _cpu_threads

    _cpu_threads()
    table = {
        "source": "measured",
        "device": _C.Engine("cpu").backend_name,
        "version": _C.__version__,
        "algorithm": "auto",
        "work_dtype": "f32",
        "shapes": [{"m": m, "n": n, "points": [list(p) for p in pts]} for (m, n), pts in points.items()],
    }
    with open(path, "w") as f:
        json.dump({"format": "distmuon-cost-table", "format_version": 1, "tables": [table]}, f)


def scenario_device() -> torch.device:
    """Where the distributed scenarios run: the CPU (gloo ranks), or the current CUDA device when
    the NCCL rig (test_gpu_distributed.py) sets DISTMUON_TEST_DEVICE=cuda for its ranks and its
    single-process reference."""
    return torch.device(os.environ.get("DISTMUON_TEST_DEVICE", "cpu"))


class TinyGPT(nn.Module):
    """Embedding, attention-like and MLP matrices (wide and tall), norms, biases and a head."""

    def __init__(self, vocab: int = 23, dim: int = 16, ctx: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(3 * dim, dim, bias=False)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out_proj = nn.Linear(4 * dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        h = h + self.proj(torch.tanh(self.qkv(self.ln(h))))
        h = h + self.out_proj(torch.nn.functional.gelu(self.fc(h)))
        return self.lm_head(h)


def make_batch(seed: int, vocab: int = 23, ctx: int = 8, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (batch, ctx + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def gpt_loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = make_batch(step)
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train(
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    steps: int,
    loss_fn: Callable[[nn.Module, int], torch.Tensor] = gpt_loss,
    schedulers: Sequence[object] = (),
    first_step: int = 0,
    after_backward: Callable[[], None] = lambda: None,
) -> list[float]:
    """Each step's loss, averaged over the ranks when torch.distributed is initialised: the global
    batch's mean loss when each rank's `loss_fn` takes its share of the batch."""
    losses = []
    for step in range(first_step, first_step + steps):
        for o in optimizers:
            o.zero_grad()
        loss = loss_fn(model, step)
        loss.backward()
        after_backward()
        for o in optimizers:
            o.step()
        for s in schedulers:
            s.step()  # type: ignore[attr-defined]
        value = loss.detach().clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(value)
            value /= dist.get_world_size()
        losses.append(value.item())
    return losses


def muon_and_adamw_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The default split of distmuon.torch.Muon, written out for the torch reference."""
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith(("wte", "wpe", "lm_head"))]
    ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in ids]


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


# ---- what the distributed scenarios return -------------------------------------------------------


def full(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor on the CPU (a DTensor gathered: collective)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t.detach()).clone().cpu()  # type: ignore[operator]


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def full_state(opt: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    """Every state tensor of `opt.state_dict()` whole (collective)."""
    sd = opt.state_dict()
    return {i: {k: full(v) for k, v in st.items()} for i, st in sd["state"].items()}


def save_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, ckpt: str) -> dict[int, dict[str, torch.Tensor]]:
    """A DCP checkpoint of `model` and `opt` in `ckpt` (collective); returns the saved state whole."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt)
    return full_state(opt)


def load_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, ckpt: str) -> dict[int, dict[str, torch.Tensor]]:
    """Loads the DCP checkpoint in `ckpt` into `model` and `opt` (collective); returns the loaded
    state whole."""
    import torch.distributed.checkpoint as dcp

    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    return full_state(opt)

"""What one engine's step takes from torch: each parameter and gradient as a DLPack capsule,
checked first, and the remapped parameters' weights and gradients moved into the engine's rows
(tensor / expert parallel layouts, ``_remap``)."""

from __future__ import annotations

from typing import Any

import torch

from distmuon.torch import _remap as remap
from distmuon.torch._device import to_dlpack
from distmuon.torch._dist import is_dtensor, local_tensor
from distmuon.torch._parts import Part
from distmuon.torch._state import Slot


def step_inputs(part: Part) -> tuple[list[Any], list[Any], list[tuple[Slot, torch.Tensor]]]:
    """DLPack capsules of every parameter and gradient (their local parts under FSDP2),
    checked before the engine touches anything, and the remapped parameters that step
    (their weights and gradients are moved into the engine's rows here: collective). The
    binding checks device, dtype and layout against the registration (naming the
    parameter); the checks here are the ones it cannot make."""
    params: list[Any] = []
    grads: list[Any] = []
    remapped: list[tuple[Slot, torch.Tensor, torch.Tensor | None]] = []
    for s in part.slots:
        p = s.param
        if p.shape != s.full_shape:
            raise RuntimeError(
                f"parameter '{s.name}' now has shape {tuple(p.shape)}, but the optimizer was "
                f"built for {tuple(s.full_shape)}; create the optimizer after changing the model"
            )
        g = p.grad
        if g is not None and s.rows is not None:
            g = _local_grad(s, g)
        if g is not None and (g.layout != torch.strided or g.shape != s.held_shape or not g.is_contiguous()):
            g = _check_grad(s, g)
        params.append(to_dlpack(s.local()))
        if s.placed is not None and s.placed.kind == "remap":
            if g is not None and g.dtype != p.dtype:
                raise ValueError(f"gradient of parameter '{s.name}' has dtype {g.dtype}, the parameter {p.dtype}")
            remapped.append((s, local_tensor(p), g))
            grads.append(None)  # below, once the ranks agree that it steps
            continue
        if g is not None and s.placed is not None and s.placed.kind == "flat":
            g = g.view(-1)
        grads.append(None if g is None else to_dlpack(g))
    stepped = []
    if remapped:
        present = remap.inbound(part.topo, part.comm, remapped, part.remap_traffic)
        for (s, w, _), on in zip(remapped, present):
            if on:
                grads[s.index] = to_dlpack(s.placed.grad)  # type: ignore[union-attr]
                stepped.append((s, w))
    return params, grads, stepped


def _local_grad(s: Slot, g: torch.Tensor) -> torch.Tensor:
    if not is_dtensor(g):
        raise ValueError(f"parameter '{s.name}' is a DTensor but its gradient is a plain tensor")
    p: Any = s.param
    if tuple(g.placements) != tuple(p.placements):  # type: ignore[attr-defined]
        raise ValueError(
            f"gradient of parameter '{s.name}' has placements {tuple(g.placements)}, the "  # type: ignore[attr-defined]
            f"parameter {tuple(p.placements)}"
        )
    return local_tensor(g)


def _check_grad(s: Slot, g: torch.Tensor) -> torch.Tensor:
    if g.layout != torch.strided:
        raise RuntimeError(f"parameter '{s.name}' has a sparse gradient ({g.layout}); distmuon needs dense gradients")
    if g.shape != s.held_shape:
        what = "local shard shape" if s.rows is not None else "shape"
        raise ValueError(
            f"gradient of parameter '{s.name}' has {what} {tuple(g.shape)}, the parameter {tuple(s.held_shape)}"
        )
    return g.contiguous()  # the engine reads dense row-major memory

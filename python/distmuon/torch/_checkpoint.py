"""Checks of a state dict before load_state_dict() changes anything (never a partial load)."""

from __future__ import annotations

import math
from typing import Any

import torch

from distmuon.torch._dist import is_dtensor, local_tensor


def check_layout(state_dict: Any) -> None:
    """A dict with a 'state' dict and a 'param_groups' list of dicts, as state_dict() makes."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"a state dict must be a dict (got {type(state_dict).__name__})")
    for key, kind in (("state", dict), ("param_groups", list)):
        if key not in state_dict:
            raise KeyError(f"the state dict has no '{key}' (keys: {sorted(map(str, state_dict))})")
        if not isinstance(state_dict[key], kind):
            raise TypeError(f"state dict '{key}' must be a {kind.__name__} (got {type(state_dict[key]).__name__})")
    for gi, sg in enumerate(state_dict["param_groups"]):
        if not isinstance(sg, dict) or not isinstance(sg.get("params"), list):
            raise TypeError(f"loaded parameter group {gi} must be a dict with a 'params' list")


def check_saved_groups(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> None:
    """Same number of groups, of parameters per group, and the same kind (Muon/AdamW) each."""
    if len(saved_groups) != len(groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer {len(groups)}")
    for gi, (g, sg) in enumerate(zip(groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(
                f"parameter group {gi} has {len(g['params'])} parameters, the loaded one {len(sg['params'])}"
            )
        if sg.get("use_muon", g["use_muon"]) != g["use_muon"]:
            kind = "Muon" if g["use_muon"] else "AdamW"
            raise ValueError(f"parameter group {gi} is {kind} here but not in the loaded state dict")
        for key in ("maximize", "amsgrad"):  # torch options this optimizer does not have
            if sg.get(key):
                raise ValueError(f"loaded parameter group {gi} has {key}=True, which distmuon does not support")


def from_torch_muon(name: str, saved_group: dict[str, Any], entry: dict[str, Any] | None) -> dict[str, Any] | None:
    """A Muon entry of a state dict saved by torch.optim.Muon (its groups have no 'use_muon') in
    this optimizer's convention. torch keeps the momentum as an average, buf = mu buf + (1 - mu) g,
    this optimizer as a sum, B = mu B + g: the same direction, scaled by 1 / (1 - mu), which
    orthogonalization ignores but the next step's mix of B and g does not."""
    if entry is None or "use_muon" in saved_group or "momentum_buffer" not in entry:
        return entry
    mu = float(saved_group.get("momentum", 0.0))
    if not 0.0 <= mu < 1.0:
        raise ValueError(f"loaded state of parameter '{name}': torch.optim.Muon's momentum {mu} cannot be converted")
    return {**entry, "momentum_buffer": entry["momentum_buffer"] / (1.0 - mu)}


def merged_groups(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The live groups with the saved options (as torch does: everything but 'params')."""
    out = []
    for g, sg in zip(groups, saved_groups):
        ng = dict(g)
        ng.update({k: v for k, v in sg.items() if k != "params"})
        out.append(ng)
    return out


def checked_entry(
    name: str,
    use_muon: bool,
    shape: torch.Size,
    state_numel: dict[str, int],
    entry: dict[str, Any] | None,
    optional: frozenset[str] = frozenset(),
) -> dict[str, Any] | None:
    """A parameter's saved state, checked against what the engine holds for it (None: fresh).
    `state_numel` maps each state name to its number of elements; names in `optional` may be
    missing (that state then starts fresh)."""
    if entry is None:
        return None
    if not isinstance(entry, dict):
        raise TypeError(f"loaded state of parameter '{name}' must be a dict (got {type(entry).__name__})")
    for key, numel in state_numel.items():
        value = entry.get(key)
        if value is None and key in optional:
            continue
        if not isinstance(value, torch.Tensor):
            kind = "Muon" if use_muon else "AdamW"
            raise ValueError(
                f"loaded state of parameter '{name}' has no tensor '{key}' (keys: {sorted(map(str, entry))}); "
                f"is it a {kind} parameter there?"
            )
        if value.numel() != numel:
            raise ValueError(f"loaded '{key}' of parameter '{name}' has shape {tuple(value.shape)}, the parameter {tuple(shape)}")
        if value.is_complex() or not value.is_floating_point():
            raise ValueError(f"loaded '{key}' of parameter '{name}' has dtype {value.dtype}")
        # This rank's part (a DTensor's local shard): every rank checks its own, the caller
        # shares the verdicts.
        local = local_tensor(value) if is_dtensor(value) else value
        if not bool(torch.isfinite(local).all()):
            raise ValueError(f"loaded '{key}' of parameter '{name}' has NaN or Inf values")
    _step_of(name, entry.get("step", 0))
    return {k: v for k, v in entry.items() if not (v is None and k in optional)}


def _step_of(name: str, value: Any) -> int:
    """A saved step count: a non-negative integer (a number or a one-element tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ValueError(f"loaded step of parameter '{name}' must be one number (got shape {tuple(value.shape)})")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"loaded step of parameter '{name}' must be a number (got {value!r:.40})")
    if not math.isfinite(value) or value < 0 or value != int(value) or value >= 2**62:
        raise ValueError(f"loaded step of parameter '{name}' is {value} (expected a count of steps)")
    return int(value)


def step_of(name: str, entry: dict[str, Any] | None) -> int:
    """The step count of a checked entry (0 for fresh state)."""
    return 0 if entry is None else _step_of(name, entry.get("step", 0))

"""Checks of a state dict before load_state_dict() changes anything (never a partial load)."""

from __future__ import annotations

from typing import Any

import torch


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
    for key, numel in state_numel.items():
        value = entry.get(key)
        if value is None and key in optional:
            continue
        if not isinstance(value, torch.Tensor):
            kind = "Muon" if use_muon else "AdamW"
            raise ValueError(
                f"loaded state of parameter '{name}' has no tensor '{key}' (keys: {sorted(entry)}); "
                f"is it a {kind} parameter there?"
            )
        if value.numel() != numel:
            raise ValueError(f"loaded '{key}' of parameter '{name}' has shape {tuple(value.shape)}, the parameter {tuple(shape)}")
        if value.is_complex() or not value.is_floating_point():
            raise ValueError(f"loaded '{key}' of parameter '{name}' has dtype {value.dtype}")
    step = float(entry.get("step", 0))
    if step < 0 or step != int(step):
        raise ValueError(f"loaded step of parameter '{name}' is {step}")
    return entry

"""The parameter groups of :class:`distmuon.torch.Muon`: which parameters a group holds, their
names, and which of them get Muon (a group without ``use_muon`` is split in two)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from distmuon.torch import _options as opt
from distmuon.torch._params import ParamInfo, check_tensor_param, default_muon_filter, matrix_shape, split_named


class ParamGroups(torch.optim.Optimizer):
    """Muon's group handling (a part of :class:`distmuon.torch.Muon`, whose constructor sets the
    attributes used here)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group; without ``use_muon`` it is split into a Muon and an AdamW group."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        group = dict(param_group)
        where = f"parameter group {len(self.param_groups)}"
        raw = group.pop("params")
        if isinstance(raw, torch.Tensor):
            raw = [raw]
        elif isinstance(raw, set):
            raise TypeError("parameters must be given in an ordered collection (a list), not a set")
        params, names = split_named(raw)
        given_names = group.pop("param_names", None)
        if names is None and given_names is not None:
            names = list(given_names)
        seen: dict[int, int] = {}
        for i, p in enumerate(params):
            if id(p) in seen:  # torch only warns; each listing would get its own update and state
                label = f"'{names[seen[id(p)]]}' and '{names[i]}'" if names else f"positions {seen[id(p)]} and {i}"
                raise ValueError(f"{where} lists one parameter twice ({label}): each parameter may appear once")
            seen[id(p)] = i
        use_muon = group.pop("use_muon", None)
        opt.check_group_keys(group, use_muon, where)

        first = sum(len(g["params"]) for g in self.param_groups)
        infos = [self._param_info(p, names[i] if names else None, first + i) for i, p in enumerate(params)]
        for p, info in zip(params, infos):
            check_tensor_param(p, info.name)
        if use_muon is None:
            muon_mask = [self._wants_muon(p, info) for p, info in zip(params, infos)]
        else:
            if not isinstance(use_muon, bool):
                raise TypeError(f"{where}: use_muon must be a bool (got {use_muon!r})")
            muon_mask = [use_muon] * len(params)
        for p, info, m in zip(params, infos, muon_mask):
            if m and p.ndim < 2:
                raise ValueError(
                    f"{where}: parameter '{info.name}' has shape {tuple(p.shape)}; Muon needs a "
                    "matrix (2D), a batch of matrices (3D) or a convolution kernel; give it AdamW"
                )
        if use_muon is None and names is None and any(muon_mask) and self._muon_filter is None:
            self._warn_unnamed()

        groups_before = len(self.param_groups)
        parts = []
        if any(muon_mask):
            parts.append((True, opt.muon_group(group, use_muon, self._muon_defaults)))
        if not all(muon_mask):
            parts.append((False, opt.adamw_group(group, use_muon, self._adamw_defaults)))
        for kind, g in parts:
            chosen = [(info.name, p) for p, info, m in zip(params, infos, muon_mask) if m == kind]
            g["params"] = chosen if names else [p for _, p in chosen]
            super().add_param_group(g)
            added = self.param_groups[-1]
            keep = set(opt.MUON_KEYS if kind else opt.ADAMW_KEYS) | {"params", "param_names", "use_muon", "initial_lr"}
            for k in [k for k in added if k not in keep]:
                del added[k]  # defaults of the other kind that torch's add_param_group filled in
        if self._parts:
            try:
                self._build_engine()
            except Exception:
                del self.param_groups[groups_before:]  # refused: the optimizer stays as it was
                raise

    def _param_info(self, p: torch.Tensor, name: str | None, index: int) -> ParamInfo:
        info = self._infos.get(id(p))
        if name is None:
            return info if info is not None else ParamInfo(f"param{index}", named=False)
        base = info or ParamInfo(name, True)
        return ParamInfo(name, True, base.embedding, base.conv)

    def _wants_muon(self, p: torch.Tensor, info: ParamInfo) -> bool:
        if self._muon_filter is not None:
            return bool(self._muon_filter(info.name, p))
        if not info.named:
            return p.ndim >= 2 and min(matrix_shape(p, False)[-2:]) > 1
        return default_muon_filter(info.name, p, info)

    def _warn_unnamed(self) -> None:
        if self._unnamed_warned:
            return
        self._unnamed_warned = True
        warnings.warn(
            "distmuon.torch.Muon got parameters without names, so embeddings and the output head "
            "cannot be recognised and every matrix gets Muon; pass the model, "
            "model.named_parameters(), or muon_filter",
            UserWarning,
            stacklevel=5,  # the caller of Muon(...)
        )

    def _named_params(self) -> list[tuple[int, str, torch.Tensor, ParamInfo]]:
        """(group index, name, parameter, info) of every parameter, in state_dict order."""
        out = []
        for gi, g in enumerate(self.param_groups):
            names = g.get("param_names")
            for j, p in enumerate(g["params"]):
                index = len(out)
                name = names[j] if names else self._param_info(p, None, index).name
                out.append((gi, name, p, self._param_info(p, name if names else None, index)))
        return out

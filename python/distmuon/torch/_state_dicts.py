"""Checkpoints of :class:`distmuon.torch.Muon`: ``state_dict()`` and ``load_state_dict()`` in
torch's format (the engine's state in each parameter's placement, ``_state``; the checks before
anything changes, ``_checkpoint``), and edits of ``optimizer.state`` applied through them."""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch

from distmuon.torch import _checkpoint as ckpt
from distmuon.torch import _options as opt
from distmuon.torch._dist import agree
from distmuon.torch._state import MATRIX_STATE, Slot, expected_numel, export_state, import_state
from distmuon.torch._state_view import edits as state_edits

# State a loaded state dict may lack (it then starts fresh): CacheMuon's entries.
OPTIONAL_STATE = frozenset(MATRIX_STATE)


class StateDicts(torch.optim.Optimizer):
    """Muon's checkpoints (a part of :class:`distmuon.torch.Muon`, whose constructor sets the
    attributes used here)."""

    def state_dict(self) -> dict[str, Any]:
        """torch's format: per parameter index 'step' and 'momentum_buffer' (Muon) or
        'exp_avg'/'exp_avg_sq' (AdamW), each shaped like its parameter: a DTensor with the
        parameter's placements under FSDP2, a full tensor otherwise, so that
        torch.distributed.checkpoint can load it at another world size. Tensors alias the
        engine's live state where it is kept in that placement (as torch's do); momentum kept
        with each matrix's owner is gathered into new tensors (collective)."""
        return self._state_dict(hooks=True)

    def _state_dict(self, hooks: bool) -> dict[str, Any]:
        """state_dict(), with the user's hooks (hooks=True) or for the optimizer's own use."""
        if self._held_params_changed():
            self._build_engine()
        # The saved buffers must assume the momentum the saved groups hold (a scheduler may have
        # changed it since the last step): bring them up to date, as the next step would.
        for gi, g in enumerate(self.param_groups):
            mu = opt.as_float(g.get("momentum", 0.0))
            if g["use_muon"] and 0.0 <= mu < 1.0:
                self._rescale_momentum(gi, mu)
        self._refresh_state()
        # torch's state_dict() runs the pre- and post-hooks around what it builds; the post-hooks
        # must see (and may replace) the complete dict, so they run here, after the engine's state.
        pre_hooks, post_hooks = self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks
        if not hooks:
            self._optimizer_state_dict_pre_hooks = type(pre_hooks)()
        self._optimizer_state_dict_post_hooks = type(post_hooks)()
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = pre_hooks, post_hooks
        for part in self._parts:
            steps = part.engine.param_steps()
            for s, entry in zip(part.slots, export_state(part.engine, part.topo, part.slots, comm=part.comm)):
                entry["step"] = torch.tensor(float(steps[s.index]))
                sd["state"][s.key] = entry
        for hook in post_hooks.values() if hooks else ():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict() of an optimizer with the same groups, saved at any world size
        (DTensor entries in any placement of this mesh, or full tensors); nothing changes unless
        every entry checks out on every rank. Collective when distributed."""
        self._load_state_dict(state_dict, hooks=True)

    def _load_state_dict(self, state_dict: dict[str, Any], hooks: bool) -> None:
        if self._held_params_changed():
            self._build_engine()
        topos = [p.topo for p in self._parts]
        try:
            if not isinstance(state_dict, dict):
                raise TypeError(f"a state dict must be a dict (got {type(state_dict).__name__})")
            state_dict = state_dict.copy()  # as torch: the pre-hooks may change it in place
            for hook in self._optimizer_load_state_dict_pre_hooks.values() if hooks else ():
                result = hook(self, state_dict)
                if result is not None:
                    state_dict = result
            ckpt.check_layout(state_dict)  # what the hooks made of it
            merged, plan = self._checked_load(state_dict)
            error = None
        except (ValueError, TypeError, KeyError) as e:
            if not any(t.distributed for t in topos):
                raise
            merged, plan, error = [], [], f"{type(e).__name__}: {e}"
        presence = "".join("0" if e is None else "1" for _, e in plan)
        for topo in topos:
            agree(topo, error, "load_state_dict", fingerprint=f"entries {presence}" if error is None else "")
        self.param_groups = merged
        entries = {s.key: e for s, e in plan}
        for part in self._parts:
            import_state(part.engine, part.topo, part.slots, [entries[s.key] for s in part.slots], comm=part.comm)
            for s in part.slots:
                entry = entries[s.key]
                part.engine.set_param_step(s.index, ckpt.step_of(s.name, entry))
        self._buffer_momentum = [opt.as_float(g.get("momentum", 0.0)) for g in self.param_groups]
        self._refresh_state()
        for hook in self._optimizer_load_state_dict_post_hooks.values() if hooks else ():
            hook(self)

    def _state_numel(self, s: Slot) -> dict[str, int]:
        engine = self._part(s).engine
        return {name: expected_numel(s, name) for name in engine.state_names(s.index)}

    def _checked_load(self, state_dict: dict[str, Any]) -> tuple[list[dict[str, Any]], list[tuple[Slot, Any]]]:
        """The merged groups and per slot the checked saved entry (None: fresh state)."""
        saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
        ckpt.check_saved_groups(self.param_groups, saved_groups)
        saved_ids = chain.from_iterable(sg["params"] for sg in saved_groups)
        saved_group_of = [sg for sg in saved_groups for _ in sg["params"]]
        plan = [
            (
                s,
                ckpt.from_torch_muon(
                    s.name,
                    sg,
                    ckpt.checked_entry(
                        s.name, s.use_muon, s.full_shape, self._state_numel(s), saved_state.get(i), OPTIONAL_STATE
                    ),
                ),
            )
            for s, i, sg in zip(self._slots, saved_ids, saved_group_of)
        ]
        old_groups = self.param_groups
        self.param_groups = ckpt.merged_groups(old_groups, saved_groups)
        try:
            for gi in range(len(self.param_groups)):
                self._group_options(gi, self._device.type)  # validates the loaded options
            return self.param_groups, plan
        finally:
            self.param_groups = old_groups

    def _apply_state_edits(self) -> None:
        """Entries of ``self.state`` deleted, emptied or given new values since it was made take
        effect now, as torch's next step would see them: a parameter without its entry starts
        fresh, a new tensor or step is loaded (and checked) like a state dict's. Collective when
        distributed (every rank edits alike, as the same training code does)."""
        changes = state_edits(self.state, self._state_original, [s.param for s in self._slots])
        sd = self._state_dict(hooks=False)
        for i, change in changes.items():
            key = self._slots[i].key
            if change is None:
                sd["state"].pop(key, None)
            else:
                sd["state"][key] = {**sd["state"][key], **change}
        self._load_state_dict(sd, hooks=False)

"""The engines of :class:`distmuon.torch.Muon`: which engines the parameters need (the
detected distributed mode, dedicated matrices), building them and carrying the state over when
the groups or parameters change, the groups' options pushed into them before each step, and
``optimizer.state`` as views of their memory."""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

from distmuon.torch import _options as opt
from distmuon.torch import _remap as remap
from distmuon.torch._device import common_device
from distmuon.torch._dist import Topology, agree, detect, is_dtensor, local_rows
from distmuon.torch._params import blocked_shape, check_tensor_param, matrix_shape, row_blocks_of
from distmuon.torch._parts import Part, build_part
from distmuon.torch._state import Slot, export_state, held_momentum, import_state, owner_held
from distmuon.torch._state_view import StateView
from distmuon.torch.dedicate import handle_of


class Engines(torch.optim.Optimizer):
    """Muon's engines (a part of :class:`distmuon.torch.Muon`, whose constructor sets the
    attributes used here)."""

    def _make_slots(self, layout: list[tuple[Topology, list[int], Any]]) -> list[Slot]:
        """Every parameter's Slot (key: its state_dict index) for the engines of `layout`.
        Slot.index is set per engine by _build_engine."""
        dedicated = {k for _, keys, h in layout if h is not None for k in keys}
        topo_of = {k: topo for topo, keys, _ in layout for k in keys}
        slots, unmatched = [], set(self._row_blocks)
        for key, (gi, name, p, info) in enumerate(self._named_params()):
            use_muon = self.param_groups[gi]["use_muon"]
            shape = matrix_shape(p, info.conv) if use_muon else list(p.shape)
            blocks = self._row_blocks_of(gi, name)
            if use_muon:
                unmatched -= {pattern for pattern in unmatched if fnmatch.fnmatchcase(name, pattern)}
            if blocks > 1:
                shape = blocked_shape(name, list(p.shape), blocks)
            topo, placed = topo_of[key], None
            if topo.layouts is not None:  # tensor / expert parallel layouts, sub-meshes
                placed = remap.place(topo, p, use_muon, int(p.shape[0]) // shape[0] if blocks > 1 else 1)
                rows = placed.member_rows[topo.member]
                if placed.kind == "flat":  # the flat boxes of a replica, end to end
                    shape = [sum(n for _, n in placed.member_rows[: topo.shard_size])]
            else:
                rows = local_rows(name, p) if is_dtensor(p) else None
            if key in dedicated and (not use_muon or len(shape) != 2):
                raise ValueError(
                    f"parameter '{name}' is dedicated (distmuon.torch.dedicate) but "
                    f"{'is in an AdamW group' if not use_muon else 'is not one matrix'}; dedicated "
                    "parameters must be Muon matrices here"
                )
            slots.append(Slot(key, gi, name, p, use_muon, shape, p.shape, p.dtype, rows, key, placed))
        if unmatched:
            raise ValueError(f"row_blocks patterns {sorted(unmatched)} match no Muon matrix of this optimizer")
        return slots

    def _group_options(self, gi: int, device_type: str) -> Any:
        g = self.param_groups[gi]
        where = f"parameter group {gi} ({'Muon' if g['use_muon'] else 'AdamW'})"
        if g["use_muon"]:
            return opt.muon_options(g, device_type, opt.engine_dtype(self._momentum_dtype), where)
        return opt.adamw_options(g, where)

    def _layout(self) -> list[tuple[Topology, list[int], Any]]:
        """(topology, state_dict keys, Dedicated handle or None) of each engine to build."""
        named = self._named_params()
        if not named:
            raise ValueError("optimizer got an empty parameter list")
        handles = {id(h): h for _, _, p, _ in named if (h := handle_of(p)) is not None}
        if len(handles) > 1:
            raise ValueError("the parameters come from several dedicate() calls; one per optimizer")
        handle = next(iter(handles.values()), None)
        ded = [k for k, (_, _, p, _) in enumerate(named) if handle is not None and handle_of(p) is handle]
        if handle is not None and len(ded) != len(handle.matrices):
            raise ValueError(
                f"the optimizer holds {len(ded)} of the {len(handle.matrices)} dedicated parameters; give "
                "it all of them (their gradients are reduced to their owners for its step)"
            )
        rest = [k for k in range(len(named)) if k not in set(ded)]
        out: list[tuple[Topology, list[int], Any]] = []
        if handle is not None:
            if self._dist_mode not in ("auto", "dedicated"):
                raise ValueError(f"dist_mode={self._dist_mode!r} but the model has dedicated parameters")
            out.append((handle.topology(), ded, handle))
        if rest:
            mode = "auto" if self._dist_mode == "dedicated" else self._dist_mode
            params = [named[k][2] for k in rest]
            # FSDP2's row shards cut through row blocks: blocked matrices take the layout path
            blocked = any(self._row_blocks_of(gi, name) > 1 for gi, name, _, _ in (named[k] for k in rest))
            topo = detect(params, [named[k][1] for k in rest], mode, self._process_group, layout=blocked)
            out.append((topo, rest, None))
        return out

    def _row_blocks_of(self, gi: int, name: str) -> int:
        """The equal row blocks ``row_blocks`` cuts a Muon matrix into (1: none)."""
        return row_blocks_of(name, self._row_blocks) if self.param_groups[gi]["use_muon"] else 1

    def _held_params_changed(self) -> bool:
        """True when the groups no longer hold exactly the registered parameters, in order: a
        group was added, or parameters were put into ``param_groups`` (as accelerate does after
        ``fully_shard``, swapping in the DTensor parameters)."""
        if not self._parts:
            return True
        held = [p for g in self.param_groups for p in g["params"]]
        return len(held) != len(self._slots) or any(p is not s.param for p, s in zip(held, self._slots))

    def _adopt_swapped_params(self) -> None:
        """Parameters put into a group in place of others: each is checked like a parameter
        given to the constructor and takes over what the model told about the one it replaced
        (an embedding, a convolution kernel). Their optimizer state starts fresh."""
        old = {(s.group, s.name): self._infos.get(id(s.param)) for s in self._slots}
        for gi, name, p, _ in self._named_params():
            check_tensor_param(p, name)
            info = old.get((gi, name))
            if id(p) not in self._infos and info is not None:
                self._infos[id(p)] = info

    def _build_engine(self, tune: bool = False) -> None:
        """(Re)creates the engines for the current groups, carrying over the state of the
        parameters that stayed (new ones start fresh). The distributed mode follows the
        parameters: plain ones swapped for FSDP2's DTensors move the optimizer from the
        replicated to the sharded mode. Collective in distributed modes."""
        layout = self._layout()
        try:
            self._adopt_swapped_params()
            slots = self._make_slots(layout)
            device = common_device([s.local() for s in slots], [s.name for s in slots])
            options = [self._group_options(gi, device.type) for gi in range(len(self.param_groups))]
            error = None
        except (ValueError, TypeError, RuntimeError) as e:
            if not any(t.distributed for t, _, _ in layout):
                raise
            error = str(e)
        for topo, _, _ in layout:
            agree(topo, error, "building distmuon.torch.Muon")
        old_parts = self._parts
        parts = []
        for topo, keys, handle in layout:
            mine = [slots[k] for k in keys]
            for i, s in enumerate(mine):
                s.index = i
            comm = next((p.comm for p in old_parts if p.topo.mode == topo.mode), None)
            if handle is not None:  # the dedicated engine shares the handle's transfers' communicator
                comm = handle.comm
            parts.append(
                build_part(
                    topo,
                    mine,
                    options,
                    device,
                    self._nonfinite,
                    self._bucket_mb,
                    self._communicator,
                    comm,
                    handle,
                    graphs=self._cuda_graphs,
                    autotune=self._autotune,
                    tune=tune,
                    wire_dtype=self._wire_dtype,
                )
            )
        carried: dict[int, tuple[dict[str, Any], int]] = {}  # id(param) -> (state, step)
        for old in old_parts:
            steps = old.engine.param_steps()
            for s, entry in zip(old.slots, export_state(old.engine, old.topo, old.slots, comm=old.comm)):
                carried[id(s.param)] = (entry, steps[s.index], s.use_muon)  # type: ignore[assignment]
        self._parts, self._slots, self._device = parts, slots, device
        held = {id(s.param) for s in slots}
        for p in [p for p in self.state if id(p) not in held]:
            del self.state[p]  # parameters no longer held: their state would keep them alive
        for part in parts:
            if old_parts:
                entries = []
                for s in part.slots:
                    c = carried.get(id(s.param))
                    ok = c is not None and c[2] == s.use_muon  # type: ignore[misc]
                    entries.append(c[0] if ok else None)  # type: ignore[index]
                    if ok:
                        part.engine.set_param_step(s.index, c[1])  # type: ignore[index]
                import_state(part.engine, part.topo, part.slots, entries, comm=part.comm)
            if part.dedicated is not None:
                early = self._nonfinite == "skip" and part.dedicated.overlap_step
                part.dedicated.bind(self._prepare_dedicated if early else None, part.engine.discard_prepared)
        # Groups that existed keep their last pushed signature and buffer momentum, so that an
        # option changed since the last step is still noticed (and the buffers rescaled) by it.
        sigs, mus = self._signatures, self._buffer_momentum
        self._signatures = [
            sigs[i] if i < len(sigs) else opt.group_signature(g) for i, g in enumerate(self.param_groups)
        ]
        self._buffer_momentum = [
            mus[i] if i < len(mus) else opt.as_float(g.get("momentum", 0.0)) for i, g in enumerate(self.param_groups)
        ]
        self._refresh_state()

    def _part(self, s: Slot) -> Part:
        return next(part for part in self._parts if any(x is s for x in part.slots))

    def _refresh_state(self) -> None:
        """``self.state[p]``: the step and the state this process holds in the parameter's
        placement (views of the engine's memory). Momentum kept with owners is not in it (it is
        not in the parameter's placement); ``state_dict()`` gathers it."""
        entries: dict[Any, dict[str, Any]] = {}
        for part in self._parts:
            exported = export_state(part.engine, part.topo, part.slots, gather_momentum=False)
            steps = part.engine.param_steps()
            for s, entry in zip(part.slots, exported):
                st = {k: v for k, v in entry.items() if not owner_held(part.topo, s, k)}
                st["step"] = torch.tensor(float(steps[s.index]))
                entries[s.param] = st
        self.state = StateView.of(entries)
        self._state_original = {id(p): dict(st) for p, st in entries.items()}

    def _push_options(self) -> None:
        """Sends changed group options (LR schedulers, user edits) to the engines."""
        for gi, g in enumerate(self.param_groups):
            sig = opt.group_signature(g)
            if sig == self._signatures[gi]:
                continue
            options = self._group_options(gi, self._device.type)  # validates before any change
            if g["use_muon"]:
                self._rescale_momentum(gi, opt.as_float(g["momentum"]))
            for part in self._parts:
                live = part.engine.group(gi)
                if g["use_muon"]:
                    live.muon = options.muon
                else:
                    live.adamw = options.adamw
            self._signatures[gi] = sig

    def _rescale_momentum(self, gi: int, mu: float) -> None:
        """Keeps the sum-form buffer B equal to E / (1 - mu) when mu changes (momentum warm-up,
        OneCycleLR), E being torch.optim.Muon's EMA buffer, so that the updates stay those of
        torch.optim.Muon for any momentum schedule. With a constant mu this never runs."""
        old = self._buffer_momentum[gi]
        if mu == old:
            return
        factor = (1.0 - old) / (1.0 - mu)
        for part in self._parts:
            for s in part.slots:
                if s.group == gi:
                    for v in held_momentum(part.engine, part.topo, s):
                        v.mul_(factor)
        self._buffer_momentum[gi] = mu

"""distmuon.torch.Muon: Muon for the hidden matrices and AdamW for everything else, in one
torch.optim.Optimizer whose arithmetic runs in the C++ engine.

The parameters, gradients and optimizer state are exchanged with the engine through DLPack
without copies: the engine updates the parameters in place, and ``optimizer.state[p]`` holds
views of the engine's own state buffers.
"""

from __future__ import annotations

import fnmatch
import math
import warnings
from itertools import chain
from typing import Any

import torch
from torch import nn

from distmuon import _C
from distmuon.torch import _checkpoint as ckpt
from distmuon.torch import _options as opt
from distmuon.torch import _remap as remap
from distmuon.torch._device import check_communicator, common_device, to_dlpack
from distmuon.torch._dist import Topology, agree, detect, is_dtensor, local_rows, local_tensor
from distmuon.torch._params import (
    MuonFilter,
    ParamInfo,
    blocked_shape,
    check_row_blocks,
    check_tensor_param,
    default_muon_filter,
    matrix_shape,
    module_param_infos,
    row_blocks_of,
    split_named,
)
from distmuon.torch._parts import Part, build_part, merge_stats
from distmuon.torch._state_view import StateView
from distmuon.torch._state_view import edits as state_edits
from distmuon.torch.dedicate import handle_of
from distmuon.torch._state import (
    MATRIX_STATE,
    Slot,
    expected_numel,
    export_state,
    held_momentum,
    import_state,
    owner_held,
)

# State a loaded state dict may lack (it then starts fresh): CacheMuon's entries.
OPTIONAL_STATE = frozenset(MATRIX_STATE)


def _float(v: Any) -> float:
    return float(v.item() if isinstance(v, torch.Tensor) else v)


class Muon(torch.optim.Optimizer):
    """Muon (orthogonalized momentum) for matrices, AdamW for the other parameters.

    Args:
        params: an ``nn.Module`` (names and module types decide who gets Muon), named
            parameters (``model.named_parameters()``), plain parameters, or parameter groups
            (dicts). A group with ``use_muon=True``/``False`` is used as given; a group without
            it is split into a Muon group and an AdamW group.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn:
            as in ``torch.optim.Muon`` (same defaults). ``ns_coefficients`` may also be a list
            of (a, b, c) rows (one per step) or a name: 'jordan', 'polar-express',
            'polar-express-1.05', 'you'. ``adjust_lr_fn`` also accepts 'spectral'.
        algorithm: the orthogonalization: 'auto' (per shape: Gram Newton-Schulz for
            rectangular matrices, symmetric-product Newton-Schulz for square ones), 'ns'
            (dense products, as torch.optim.Muon), 'ns-sym' or 'gram-ns'.
        ns_dtype: dtype the iteration runs in; None picks bfloat16 on CUDA (as
            torch.optim.Muon) and float32 on the CPU.
        cache_gamma: CacheMuon (docs/algorithms.md section 5): reuse each matrix's last Gram-NS
            transform while ``||Q X (Q X)^T - I||_F / sqrt(m) <= cache_gamma``; None (default)
            keeps it off. It applies to the shapes orthogonalized with Gram NS ('gram-ns', or the
            elongated shapes of 'auto'). Its entries are saved by ``state_dict()``.
        cache_probes: k (default 8) estimates the residual with k Gaussian probes; None measures
            it exactly in Gram space (a little cheaper only on small, launch-bound shapes).
        cache_max_staleness: refresh an entry after this many reuses (0 or None: no limit).
        cache_check_backoff: an entry that keeps failing its test is tested again after 1, 2,
            4, ... refreshes, at most this many (0 or None, default: tested every step). Inside
            the CUDA step graph a step none of whose matrices is due skips the test's kernels.
        cache_gate: 'matrix' (default): each matrix hits or refreshes on its own residual;
            'batch': a batch of same-shape matrices (one call) hits only when every matrix in it
            passes, else all of them refresh. It pays on small, launch-bound shapes, where a
            batch of mixed decisions costs more than a fresh solve (docs/cachemuon.md); its
            decisions depend on how the matrices are batched (the distributed mode and plan).
        cache_dtype: storage dtype of the cached transforms (float32, float16 or bfloat16);
            None (default): the Gram-NS work dtype, so that no step converts them.
        cache_shadow: diagnostics: also run the fresh solve for accepted matrices and report the
            relative error and alignment of the accepted updates in ``stats()`` (synchronises).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW part (embeddings,
            output head, norms, biases), with ``torch.optim.AdamW``'s defaults (1e-3,
            (0.9, 0.999), 1e-8, 0.01) whatever ``lr`` is: Muon's learning rate is typically
            several to tens of times AdamW's, so the AdamW part never follows it.
        betas: ``adamw_betas`` under the name ``torch.optim.AdamW`` uses (give one of the two).
            ``eps`` is ``torch.optim.Muon``'s (the Newton-Schulz normalisation); AdamW's is
            ``adamw_eps``.
        muon_filter: ``(name, param) -> bool`` that replaces the default choice of Muon
            parameters (matrices that are not embeddings or the output head).
        momentum_dtype: torch.float32 (default) or torch.bfloat16.
        nonfinite: 'skip' (default: a matrix or tensor whose gradient has NaN/Inf is left
            untouched in that step and counted) or 'raise' (nothing is updated; error).
        dist_mode: 'auto' (default) detects the setting: DTensor parameters (FSDP2
            ``fully_shard``, HSDP, tensor / expert parallelism on sub-meshes of one mesh) ->
            'sharded' over their device mesh (docs/distributed.md); plain parameters with
            torch.distributed initialised over more than one process (DDP) -> 'replicated';
            else 'local'. 'gather' is the naive baseline for FSDP2's DTensor parameters.
        process_group: the group of the replicated mode (default: the whole world).
        bucket_mb: megabytes of full matrices moved per bucket in the distributed modes (the
            next bucket travels while the current one computes); None (default): the engine's
            (``DistOptions().bucket_bytes``, 32 MiB).
        wire_dtype: None (default: each parameter's dtype) or torch.bfloat16: in the sharded and
            gather modes (FSDP2, HSDP), float32 parameters' gradient rows and updates travel in
            bfloat16, half the optimizer's traffic, each rounded once (docs/distributed.md,
            "The wire's precision"). Refused where the replicated mode (DDP) moves weights;
            nothing travels in one process.
        communicator: how the engine's collectives travel: 'auto' (NCCL for CUDA parameters
            when the build has it, else 'torch'), 'torch' (over the torch.distributed process
            group: gloo on the CPU), 'nccl', or 'mpi' (CPU, under mpirun, in a build with MPI).
            Dedicated matrices travel on the communicator ``dedicate(communicator=...)`` chose.
        cuda_graphs: on one CUDA device (no process group), the engine captures its step into a
            CUDA graph once two steps in a row used the same gradient and parameter buffers,
            and replays it from then on: the step then costs one launch of host time. The
            learning rate, weight decay and momentum are read on the device, so a scheduler
            keeps the graph. CacheMuon steps replay too; steps with ``nonfinite='raise'`` or
            ``cache_shadow=True`` are issued eagerly, and inside your own CUDA graph capture
            the step is recorded there (with the hyperparameters of that capture). ``False``
            issues every step eagerly (``DISTMUON_GRAPHS=0|1`` overrides either way).
        autotune: how ``algorithm='auto'`` picks per shape class on a tuned backend (CUDA):
            'on' (default) measures ns5, ns5-sym and Gram NS on each class the measurement
            store (``DISTMUON_COST_CACHE``, default ``~/.cache/distmuon/costs.json``) lacks,
            once per shape, batch size and device, when the engine is built (the first step, or
            :meth:`tune`), with one line per class on stderr; 'cached' takes the stored
            measurements and predicts the other classes with a cost model calibrated on them;
            'off' takes the aspect-ratio heuristic. ``DISTMUON_AUTOTUNE`` overrides. The CPU
            backend is not tuned: the heuristic.
        row_blocks: orthogonalize equal row blocks of a fused matrix separately, as if they were
            separate matrices (dion's ``split_sizes``, Megatron's ``split_qkv``): a dict of
            parameter name pattern (``fnmatch``, e.g. ``"*.wqkv.weight"``) -> number of blocks,
            such as 3 for a fused q, k, v of equal sizes, 2 for a fused gate-up projection, or
            the number of heads for one block per head. Each block gets its own update scale
            and, distributed, its own owner. Default: none (each matrix orthogonalized whole,
            torch.optim.Muon's behaviour). Patterns apply to the Muon matrices (2D); one that
            matches none is an error.

    Distributed: every rank builds the optimizer and steps it together (the step is
    collective), and so are ``state_dict()``/``load_state_dict()`` when momentum lives with
    each matrix's owner (the 'replicated' and 'sharded' modes).

    The momentum buffer is kept in the sum form ``B = mu B + G`` (as torch.optim.SGD);
    torch.optim.Muon keeps the EMA form, which is ``(1 - mu)`` times it; when a scheduler changes
    ``mu`` the buffers are rescaled so that the updates stay torch.optim.Muon's. The input of the
    iteration is ``U / (||U|| + eps)`` where torch uses ``U / max(||U||, eps)`` (a relative
    difference of eps / ||U||).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = opt.JORDAN_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        algorithm: str = "auto",
        ns_dtype: torch.dtype | str | None = None,
        cache_gamma: float | None = None,
        cache_probes: int | None = 8,
        cache_max_staleness: int | None = 0,
        cache_check_backoff: int | None = 0,
        cache_gate: str = "matrix",
        cache_dtype: torch.dtype | str | None = None,
        cache_shadow: bool = False,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] | None = None,
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.01,
        betas: tuple[float, float] | None = None,
        muon_filter: MuonFilter | None = None,
        momentum_dtype: torch.dtype = torch.float32,
        nonfinite: str = "skip",
        dist_mode: str = "auto",
        process_group: Any = None,
        bucket_mb: float | None = None,
        wire_dtype: torch.dtype | None = None,
        communicator: str = "auto",
        cuda_graphs: bool = True,
        autotune: str = "on",
        row_blocks: dict[str, int] | None = None,
    ) -> None:
        if momentum_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"momentum_dtype must be torch.float32 or torch.bfloat16 (got {momentum_dtype})")
        if nonfinite not in ("skip", "raise"):
            raise ValueError(f"nonfinite must be 'skip' or 'raise' (got {nonfinite!r})")
        if autotune not in ("on", "cached", "off"):
            raise ValueError(f"autotune must be 'on', 'cached' or 'off' (got {autotune!r})")
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be True or False (got {cuda_graphs!r})")
        check_communicator(communicator)  # also in one process: a typo must not wait for a launch
        if muon_filter is not None and not callable(muon_filter):
            raise TypeError("muon_filter must be a callable (name, param) -> bool")
        self._muon_defaults: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "algorithm": algorithm,
            "ns_dtype": None if ns_dtype is None else opt.torch_dtype_name(ns_dtype),
            "cache_gamma": cache_gamma,
            "cache_probes": cache_probes,
            "cache_max_staleness": cache_max_staleness,
            "cache_check_backoff": cache_check_backoff,
            "cache_gate": cache_gate,
            "cache_dtype": None if cache_dtype is None else opt.torch_dtype_name(cache_dtype),
            "cache_shadow": cache_shadow,
        }
        if adamw_lr is None:
            raise TypeError("adamw_lr must be a number: the AdamW part has its own learning rate (default 1e-3)")
        if betas is not None and adamw_betas is not None:
            raise ValueError(opt.BETAS_TWICE)
        self._adamw_defaults: dict[str, Any] = {
            "lr": adamw_lr,
            "betas": tuple(betas or adamw_betas or (0.9, 0.999)),
            "eps": adamw_eps,
            "weight_decay": adamw_weight_decay,
        }
        self._muon_filter = muon_filter
        self._row_blocks = check_row_blocks(row_blocks)
        if bucket_mb is not None:
            if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
                raise TypeError(f"bucket_mb must be a number of megabytes or None (got {bucket_mb!r})")
            if not (math.isfinite(bucket_mb) and 0 < bucket_mb <= 2**40):
                raise ValueError(f"bucket_mb must be a finite number in (0, 2**40] (got {bucket_mb})")
        if wire_dtype not in (None, torch.bfloat16):
            raise ValueError(f"wire_dtype must be None or torch.bfloat16 (got {wire_dtype!r})")
        self._wire_dtype = "bf16" if wire_dtype is torch.bfloat16 else ""
        self._momentum_dtype = momentum_dtype
        self._nonfinite = nonfinite
        self._cuda_graphs = cuda_graphs
        self._autotune = autotune
        self._dist_mode = dist_mode
        self._process_group = process_group
        self._bucket_mb = bucket_mb
        self._communicator = communicator
        self._infos: dict[int, ParamInfo] = {}
        self._parts: list[Part] = []  # the engines: one, or two with dedicated matrices
        self._slots: list[Slot] = []  # every parameter, in state_dict order
        self._signatures: list[tuple[Any, ...] | None] = []
        self._buffer_momentum: list[float] = []  # per group: the mu its momentum buffers assume
        self._unnamed_warned = False
        if isinstance(params, nn.Module):
            self._infos = module_param_infos(params)
            params = list(params.named_parameters())
        defaults = dict(self._muon_defaults)
        defaults.update({f"adamw_{k}": v for k, v in self._adamw_defaults.items()})
        super().__init__(params, defaults)
        self._build_engine()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(
            "distmuon.torch.Muon cannot be copied or pickled (it holds native engines and, when "
            "distributed, communicators): save opt.state_dict() and load it into a new Muon"
        )

    # ---- parameter groups -----------------------------------------------------------------

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

    # ---- the engine -------------------------------------------------------------------------

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
            mus[i] if i < len(mus) else _float(g.get("momentum", 0.0)) for i, g in enumerate(self.param_groups)
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

    def _push_options(self) -> None:
        """Sends changed group options (LR schedulers, user edits) to the engines."""
        for gi, g in enumerate(self.param_groups):
            sig = opt.group_signature(g)
            if sig == self._signatures[gi]:
                continue
            options = self._group_options(gi, self._device.type)  # validates before any change
            if g["use_muon"]:
                self._rescale_momentum(gi, _float(g["momentum"]))
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

    def _step_inputs(self, part: Part) -> tuple[list[Any], list[Any], list[tuple[Slot, torch.Tensor]]]:
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
                g = self._local_grad(s, g)
            if g is not None and (g.layout != torch.strided or g.shape != s.held_shape or not g.is_contiguous()):
                g = self._check_grad(s, g)
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

    @staticmethod
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

    @staticmethod
    def _check_grad(s: Slot, g: torch.Tensor) -> torch.Tensor:
        if g.layout != torch.strided:
            raise RuntimeError(
                f"parameter '{s.name}' has a sparse gradient ({g.layout}); distmuon needs dense gradients"
            )
        if g.shape != s.held_shape:
            what = "local shard shape" if s.rows is not None else "shape"
            raise ValueError(
                f"gradient of parameter '{s.name}' has {what} {tuple(g.shape)}, the parameter "
                f"{tuple(s.held_shape)}"
            )
        return g.contiguous()  # the engine reads dense row-major memory

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One optimizer step over every parameter that has a gradient (collective when
        distributed: a parameter steps on every rank or on none)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self.state, "edited", False):
            self._apply_state_edits()
        if self._held_params_changed():
            self._build_engine()
        self._push_options()
        # The dedicated engine first: its publication to other replicas (HSDP) then travels
        # while the other engine steps.
        for part in self._parts:
            if part.dedicated is not None:
                part.dedicated.before_step()  # reductions complete, owners hold mean gradients
            params, grads, remapped = self._step_inputs(part)
            part.order.before()
            part.engine.step(params, grads)
            remap.outbound(part.topo, part.comm, remapped, part.remap_traffic)  # new weights into their placements
            if part.dedicated is not None:
                part.dedicated.after_step()
        return loss

    @torch.no_grad()
    def _prepare_dedicated(self, params: list[torch.Tensor], stream: Any) -> None:
        """Dedicated matrices whose reduced gradients landed on this rank (their owner) during
        backward: momentum and orthogonalization now, on `stream` (CUDA) or inline (CPU)."""
        part = next(p for p in self._parts if p.dedicated is not None)
        self._push_options()  # the momentum and cache options of this step
        slots = part.index_of(params)
        if stream is not None:
            part.order.switch(stream)
        elif not part.order.cuda:
            part.order.before()  # the CPU's thread count (the CUDA path as it was)
        part.engine.prepare(
            [s.index for s in slots], [to_dlpack(s.param) for s in slots], [to_dlpack(s.param.grad) for s in slots]
        )

    @property
    def dist_mode(self) -> str:
        """The engine's setting: 'local', 'replicated', 'sharded', 'gather', or 'dedicated' when
        some matrices are dedicated (the others then step in the mode detected for them, see
        ``dist_modes``)."""
        return "dedicated" if any(p.dedicated is not None for p in self._parts) else self._parts[0].topo.mode

    @property
    def dist_modes(self) -> list[str]:
        """The mode of each engine (two with dedicated matrices: 'dedicated' and the others')."""
        return [p.topo.mode for p in self._parts]

    def tune(self) -> list[dict[str, Any]]:
        """Measures the algorithms of ``algorithm='auto'`` now on every shape class that the
        measurement store lacks for this device (whatever ``autotune`` says; one line per class
        on stderr), keeps the results in the store for the next runs, and runs the fastest from
        the next step on. Returns one dict per ``auto`` class: ``group``, ``rows`` x ``cols``
        (wide), ``count`` (matrices), ``algorithm``, ``restarts``, ``source`` ('measured',
        'stored' or 'heuristic') and ``ms`` (the batch's measured
        time). It rebuilds the engines with the groups' current options, carrying the state
        over, so call it before training; distributed it is collective (every rank). On the CPU
        every answer is the heuristic."""
        self._build_engine(tune=True)
        return self.tuned_shapes()

    def tuned_shapes(self) -> list[dict[str, Any]]:
        """How ``algorithm='auto'`` was resolved for each shape class when the engine was last
        built or tuned, as :meth:`tune` returns it."""
        return [row for p in self._parts for row in p.engine.tuned_shapes()]

    def engine_stats(self) -> dict[str, Any]:
        """Counters of the engines (summed over them): steps, non-finite skips, orthogonalization
        FLOPs, sizes, communication, and CacheMuon's counters under 'cache'; and the bytes the
        front moved for tensor / expert parallel parameters in steps (``remap_bytes_sent``,
        ``remap_bytes_received``; checkpoints not counted). Synchronises."""
        stats = [p.engine.stats() for p in self._parts]
        out = stats[0]
        for st in stats[1:]:
            out = merge_stats(out, st)
        out["remap_bytes_sent"] = sum(p.remap_traffic[0] for p in self._parts)
        out["remap_bytes_received"] = sum(p.remap_traffic[1] for p in self._parts)
        return out
    def stats(self) -> dict[str, Any]:
        """A summary of this rank's work (synchronises the device; not collective):

        - ``steps``, ``nonfinite_skips``, ``ortho_flops`` (cumulative orthogonalization FLOPs
          this rank ran, CacheMuon's counted as an ideal device does them), ``owned_matrices``;
        - ``graph_captures`` and ``graph_replays``: steps captured into a CUDA graph and steps
          that replayed it (``cuda_graphs``);
        - CacheMuon (zeros when off): ``cache_hits``, ``cache_refreshes`` (cumulative; of
          which ``cache_unchecked_refreshes`` the check back-off sent without a test, and
          ``cache_batch_refreshes`` the ``cache_gate='batch'`` sent although the matrix passed),
          ``cache_hit_rate`` (cumulative), ``cache_flops_saved`` (fraction of the fresh solves'
          FLOPs saved), ``last_hit_rate`` and ``last_mean_residual`` (the latest step: the share
          of matrices that reused their transform and the mean residual of the test), and with
          ``cache_shadow=True`` ``last_update_rel_err`` (mean relative Frobenius distance of the
          latest step's accepted updates from the fresh ones; 0 when none was accepted) and
          ``last_alignment`` (their mean cosine; 1 when none).
        """
        e = self.engine_stats()
        c = e["cache"]
        out: dict[str, Any] = {
            "steps": e["steps"],
            "nonfinite_skips": e["nonfinite_skips"],
            "ortho_flops": e["ortho_flops"],
            "owned_matrices": e["owned_matrices"],
            "graph_captures": e["graph_captures"],
            "graph_replays": e["graph_replays"],
            "cache_hits": c["hits"],
            "cache_refreshes": c["refreshes"],
            "cache_unchecked_refreshes": c["unchecked_refreshes"],
            "cache_batch_refreshes": c["batch_refreshes"],
            "cache_hit_rate": c["hit_rate"],
            "cache_flops_saved": c["flops_saved_fraction"],
            "last_hit_rate": c["latest_hit_rate"],
            "last_mean_residual": c["latest_mean_residual"],
        }
        if any(g.get("cache_shadow") and g.get("cache_gamma") is not None for g in self.param_groups):
            out["last_update_rel_err"] = c["latest_update_error"]
            out["last_alignment"] = c["latest_alignment"]
        return out

    # ---- checkpoints --------------------------------------------------------------------------

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
            mu = _float(g.get("momentum", 0.0))
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
        self._buffer_momentum = [_float(g.get("momentum", 0.0)) for g in self.param_groups]
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

"""distmuon.torch.Muon: Muon for the hidden matrices and AdamW for everything else, in one
torch.optim.Optimizer whose arithmetic runs in the C++ engine.

The parameters, gradients and optimizer state are exchanged with the engine through DLPack
without copies: the engine updates the parameters in place, and ``optimizer.state[p]`` holds
views of the engine's own state buffers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from distmuon.torch import _options as opt
from distmuon.torch import _remap as remap
from distmuon.torch._device import check_communicator, to_dlpack
from distmuon.torch._engines import Engines
from distmuon.torch._param_groups import ParamGroups
from distmuon.torch._params import MuonFilter, ParamInfo, check_row_blocks, module_param_infos
from distmuon.torch._parts import Part, merge_stats
from distmuon.torch._state import Slot
from distmuon.torch._state_dicts import StateDicts
from distmuon.torch._step_inputs import step_inputs


# Muon's methods are split by responsibility over its bases: the parameter groups
# (_param_groups.py), the engines (_engines.py) and the checkpoints (_state_dicts.py); here are the
# constructor, the step and what the engines report. The constructor sets every attribute the
# bases use; each base is a torch.optim.Optimizer, so that their super() calls reach torch's.
class Muon(ParamGroups, Engines, StateDicts):
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
            (``DistOptions().bucket_bytes``, 1 GiB).
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
            params, grads, remapped = step_inputs(part)
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
        - ``issue_ms``: host milliseconds the engines spent issuing the last step's work (summed
          over the engines; in a distributed step from after the ranks' vote to the wait for its
          collectives): what a step costs the host beside what it costs the device;
        - ``memory_bytes`` and ``memory_peak_bytes``: device (or host, CPU) memory the engines
          hold outside PyTorch's allocator (momentum, stages, workspaces, communication
          buffers), now and at the most, summed over the engines; ``torch.cuda.memory_allocated``
          does not see it;
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
            "memory_bytes": e["memory_bytes"],
            "memory_peak_bytes": e["memory_peak_bytes"],
            "graph_captures": e["graph_captures"],
            "graph_replays": e["graph_replays"],
            "issue_ms": e["issue_ms"],
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

"""Parameter-group options of :class:`distmuon.torch.Muon`: defaults, validation, and their
translation into the C++ engine's ``GroupOptions``.

A group is either a Muon group (``use_muon=True``, keys as in ``torch.optim.Muon``) or an AdamW
group (``use_muon=False``, keys as in ``torch.optim.AdamW``).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from distmuon import _C

JORDAN_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)

# Named coefficient sets the engine knows (docs/algorithms.md sections 2 and 3).
NAMED_COEFFICIENTS: dict[str, Any] = {
    "jordan": _C.Coefficients.jordan,
    "polar-express": _C.Coefficients.polar_express,
    "polar-express-1.05": _C.Coefficients.polar_express_1_05,
    "you": _C.Coefficients.you,
}

# torch.optim.Muon's adjust_lr_fn names, plus "spectral" (dion's name for spectral_unclamped).
SCALE_MODES: dict[str | None, Any] = {
    None: _C.ScaleMode.original,
    "original": _C.ScaleMode.original,
    "match_rms_adamw": _C.ScaleMode.match_rms_adamw,
    "spectral": _C.ScaleMode.spectral,
    "spectral_unclamped": _C.ScaleMode.spectral,
}

MUON_KEYS = (
    "lr",
    "weight_decay",
    "momentum",
    "nesterov",
    "ns_coefficients",
    "eps",
    "ns_steps",
    "adjust_lr_fn",
    "algorithm",
    "ns_dtype",
    "cache_gamma",
    "cache_probes",
    "cache_max_staleness",
    "cache_check_backoff",
    "cache_gate",
    "cache_dtype",
    "cache_shadow",
)
ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
# AdamW's betas may be given under torch.optim.AdamW's name or as adamw_betas, not both.
BETAS_TWICE = "betas and adamw_betas both set the AdamW part's betas: give one of them"
# Keys of a mixed user group (no use_muon) that configure its AdamW part.
ADAMW_ALIASES = {
    "adamw_lr": "lr",
    "adamw_betas": "betas",
    "adamw_eps": "eps",
    "adamw_weight_decay": "weight_decay",
}

_DTYPES = {
    "float32": _C.DType.f32,
    "float64": _C.DType.f64,
    "bfloat16": _C.DType.bf16,
    "float16": _C.DType.f16,
}


def torch_dtype_name(dtype: torch.dtype | str) -> str:
    """'float32', 'bfloat16', ... for a torch dtype or one of those names."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}: use float32, float64, bfloat16 or float16")
    return name


def engine_dtype(dtype: torch.dtype | str) -> Any:
    return _DTYPES[torch_dtype_name(dtype)]


def as_float(value: Any) -> float:
    """A group value as a float: a number, or a one-element tensor (torch takes tensor hyperparameters)."""
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _scalar(group: dict[str, Any], key: str, where: str) -> float:
    value = group[key]
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where}: Tensor {key} must have one element (got {value.numel()})")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {key} must be a number (got {value!r})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be finite (got {value})")
    return value


def _coefficient_rows(value: Any, where: str) -> list[tuple[float, float, float]] | str:
    """A coefficient-set name, or the rows of a custom schedule (one (a, b, c) per step)."""
    if isinstance(value, str):
        if value not in NAMED_COEFFICIENTS:
            raise ValueError(
                f"{where}: unknown ns_coefficients {value!r} "
                f"(expected an (a, b, c) tuple, a list of them, or one of {sorted(NAMED_COEFFICIENTS)})"
            )
        return value
    rows = [value] if len(value) == 3 and not isinstance(value[0], Sequence) else list(value)
    out = []
    for row in rows:
        if not isinstance(row, Sequence) or len(row) != 3:
            raise ValueError(f"{where}: ns_coefficients must be (a, b, c) or a list of them (got {value!r})")
        a, b, c = (float(x) for x in row)
        if not all(math.isfinite(x) for x in (a, b, c)):
            raise ValueError(f"{where}: ns_coefficients must be finite (got {row!r})")
        out.append((a, b, c))
    if not out:
        raise ValueError(f"{where}: ns_coefficients is empty")
    return out


def ortho_config(group: dict[str, Any], device_type: str, where: str) -> Any:
    """The engine's OrthoConfig of a Muon group, validated."""
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= _C.MAX_ORTHO_STEPS:
        raise ValueError(f"{where}: ns_steps must be an integer in [1, {_C.MAX_ORTHO_STEPS}] (got {steps!r})")
    eps = _scalar(group, "eps", where)
    if eps <= 0:
        raise ValueError(f"{where}: eps must be > 0 (got {eps})")

    base = _C.OrthoConfig()
    base.steps = steps
    base.eps = eps
    coeffs = _coefficient_rows(group["ns_coefficients"], where)
    if isinstance(coeffs, str):
        base.coefficients = NAMED_COEFFICIENTS[coeffs]
    elif coeffs == [JORDAN_COEFFICIENTS]:
        base.coefficients = _C.Coefficients.jordan
    else:
        base.coefficients = _C.Coefficients.custom
        base.custom_coefficients = [_C.QuinticCoef(*row) for row in coeffs]

    algorithm = group["algorithm"]
    if not isinstance(algorithm, str):
        raise TypeError(f"{where}: algorithm must be a string such as 'auto' or 'ns5' (got {algorithm!r})")
    try:
        cfg = _C.parse_algorithm(algorithm, base)
    except _C.Error as e:  # its message alone: no "distmuon: " prefix, no " [file.cc:line]"
        message = re.sub(r" \[[\w.]+:\d+\]$", "", str(e).removeprefix("distmuon: "))
        raise ValueError(f"{where}: {message}") from None
    # A spec such as 'ns5' or 'gram-ns:you' may also name steps or coefficients: they must agree
    # with ns_steps / ns_coefficients rather than silently win.
    if cfg.steps != steps:
        raise ValueError(f"{where}: algorithm {algorithm!r} runs {cfg.steps} steps but ns_steps={steps}")
    if cfg.coefficients != base.coefficients and group["ns_coefficients"] != JORDAN_COEFFICIENTS:
        raise ValueError(
            f"{where}: algorithm {algorithm!r} names coefficients that differ from "
            f"ns_coefficients={group['ns_coefficients']!r}; give them in one place"
        )

    ns_dtype = group["ns_dtype"]
    if ns_dtype is None:  # torch.optim.Muon iterates in bf16; on CPU fp32 is faster and exact
        ns_dtype = "bfloat16" if device_type == "cuda" else "float32"
    cfg.work_dtype = engine_dtype(ns_dtype)
    return cfg


def muon_options(group: dict[str, Any], device_type: str, momentum_dtype: Any, where: str) -> Any:
    """The engine's GroupOptions of a Muon group, validated."""
    lr = _scalar(group, "lr", where)
    wd = _scalar(group, "weight_decay", where)
    mu = _scalar(group, "momentum", where)
    if lr < 0:
        raise ValueError(f"{where}: lr must be >= 0 (got {lr})")
    if wd < 0:
        raise ValueError(f"{where}: weight_decay must be >= 0 (got {wd})")
    if not 0 <= mu < 1:
        raise ValueError(f"{where}: momentum must be in [0, 1) (got {mu})")
    if not isinstance(group["nesterov"], bool):
        raise TypeError(f"{where}: nesterov must be a bool (got {group['nesterov']!r})")
    if group["adjust_lr_fn"] not in SCALE_MODES:
        raise ValueError(
            f"{where}: adjust_lr_fn {group['adjust_lr_fn']!r} is not one of "
            "None, 'original', 'match_rms_adamw', 'spectral' ('spectral_unclamped')"
        )
    cache = cache_options(group, where)
    opts = _C.GroupOptions()
    opts.kind = _C.ParamKind.muon
    m = opts.muon
    m.lr, m.weight_decay, m.momentum, m.nesterov = lr, wd, mu, group["nesterov"]
    m.scale = SCALE_MODES[group["adjust_lr_fn"]]
    m.ortho = ortho_config(group, device_type, where)
    if cache.enabled and m.ortho.iteration in (_C.Iteration.ns, _C.Iteration.ns_sym):
        warnings.warn(
            f"{where}: cache_gamma is set, but algorithm {group['algorithm']!r} is standard NS: "
            "CacheMuon reuses Gram NS transforms, so this group's matrices never hit the cache",
            stacklevel=2,
        )
    m.momentum_dtype = momentum_dtype
    m.cache = cache
    return opts


_CACHE_DTYPES = ("float32", "float16", "bfloat16", "float64")
_CACHE_GATES = ("matrix", "batch")


def cache_options(group: dict[str, Any], where: str) -> Any:
    """The engine's CacheOptions of a Muon group, validated (CacheMuon: docs/algorithms.md
    section 5).

    ``cache_gamma`` None keeps the cache off (the other cache keys are still checked);
    ``cache_probes`` k (default 8) estimates the residual with k Gaussian probes, None measures it
    exactly in Gram space; ``cache_max_staleness`` 0 (or None) lets an entry serve any number of steps;
    ``cache_check_backoff`` 0 (or None) tests every entry at every step;
    ``cache_gate`` 'matrix' decides per matrix, 'batch' per call of a batch (all hit or all refresh);
    ``cache_dtype`` stores the transforms (None: in the work dtype); ``cache_shadow`` also runs
    the fresh solve for accepted matrices to measure how far their updates are (diagnostics;
    synchronises)."""
    gamma = group["cache_gamma"]
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma < math.inf):
        raise ValueError(f"{where}: cache_gamma must be a positive number or None (got {gamma!r})")
    probes = group["cache_probes"]
    if probes is not None and (isinstance(probes, bool) or not isinstance(probes, int) or not 1 <= probes <= 4096):
        raise ValueError(f"{where}: cache_probes must be None (exact residual) or an integer in [1, 4096] (got {probes!r})")
    staleness = group["cache_max_staleness"]
    staleness = 0 if staleness is None else staleness
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"{where}: cache_max_staleness must be an integer >= 0 or None (got {staleness!r})")
    backoff = group["cache_check_backoff"]
    backoff = 0 if backoff is None else backoff
    if isinstance(backoff, bool) or not isinstance(backoff, int) or backoff < 0:
        raise ValueError(f"{where}: cache_check_backoff must be an integer >= 0 or None (got {backoff!r})")
    gate = group["cache_gate"]
    if not isinstance(gate, str) or gate not in _CACHE_GATES:
        raise ValueError(f"{where}: cache_gate must be 'matrix' or 'batch' (got {gate!r})")
    dtype = None if group["cache_dtype"] is None else torch_dtype_name(group["cache_dtype"])
    if dtype is not None and dtype not in _CACHE_DTYPES:
        raise ValueError(f"{where}: cache_dtype must be one of {_CACHE_DTYPES} (got {dtype})")
    if not isinstance(group["cache_shadow"], bool):
        raise TypeError(f"{where}: cache_shadow must be a bool (got {group['cache_shadow']!r})")
    c = _C.CacheOptions()
    c.enabled = gamma is not None
    if gamma is not None:
        c.gamma = float(gamma)
    c.residual = _C.CacheResidual.exact if probes is None else _C.CacheResidual.probe
    if probes is not None:
        c.probes = probes
    c.max_staleness = staleness
    c.check_backoff = backoff
    c.gate = _C.CacheGate.batch if gate == "batch" else _C.CacheGate.matrix
    c.dtype = None if dtype is None else _DTYPES[dtype]
    c.shadow = group["cache_shadow"]
    return c


def adamw_options(group: dict[str, Any], where: str) -> Any:
    """The engine's GroupOptions of an AdamW group, validated."""
    lr = _scalar(group, "lr", where)
    eps = _scalar(group, "eps", where)
    wd = _scalar(group, "weight_decay", where)
    betas = group["betas"]
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (got {betas!r})")
    b1, b2 = (float(b.item() if isinstance(b, torch.Tensor) else b) for b in betas)
    if "momentum" in group:
        # OneCycleLR / CyclicLR cycle "momentum" on every group of an optimizer whose defaults
        # have no "betas" (ours: Muon groups have momentum). For AdamW that value is beta1, which
        # is what those schedulers set on torch.optim.AdamW.
        b1 = _scalar(group, "momentum", where)
    if lr < 0:
        raise ValueError(f"{where}: lr must be >= 0 (got {lr})")
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"{where}: betas must be in [0, 1) (got {betas!r})")
    if eps <= 0:
        raise ValueError(f"{where}: eps must be > 0 (got {eps})")
    if wd < 0:
        raise ValueError(f"{where}: weight_decay must be >= 0 (got {wd})")
    opts = _C.GroupOptions()
    opts.kind = _C.ParamKind.adamw
    a = opts.adamw
    a.lr, a.beta1, a.beta2, a.eps, a.weight_decay = lr, b1, b2, eps, wd
    return opts


def group_signature(group: dict[str, Any]) -> tuple[Any, ...]:
    """The values of a group's options, to notice changes (schedulers) between steps."""
    keys = MUON_KEYS if group["use_muon"] else ADAMW_KEYS + (("momentum",) if "momentum" in group else ())
    out = []
    for k in keys:
        v = group[k]
        if isinstance(v, torch.Tensor):
            v = v.item()
        elif isinstance(v, list):
            v = repr(v)
        out.append(v)
    return tuple(out)


# ---- user groups -> complete groups ------------------------------------------------------------


def check_group_keys(group: dict[str, Any], use_muon: bool | None, where: str) -> None:
    """Unknown keys are errors (a typo would otherwise be a silently ignored option)."""
    if use_muon is True:
        allowed = set(MUON_KEYS)
    elif use_muon is False:
        allowed = set(ADAMW_KEYS) | set(ADAMW_ALIASES)
    else:
        allowed = set(MUON_KEYS) | set(ADAMW_ALIASES) | {"betas"}
    allowed |= {"initial_lr"} if use_muon is not None else set()
    unknown = sorted(set(group) - allowed)
    if unknown:
        kind = {True: "a Muon group", False: "an AdamW group", None: "a mixed group"}[use_muon]
        raise ValueError(f"{where}: unknown option(s) {unknown} for {kind} (allowed: {sorted(allowed)})")


def muon_group(group: dict[str, Any], use_muon: bool | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """The complete Muon group for a user group (its keys over the constructor's defaults)."""
    out = {k: group.get(k, defaults[k]) for k in MUON_KEYS}
    if out["ns_dtype"] is not None:
        out["ns_dtype"] = torch_dtype_name(out["ns_dtype"])
    if out["cache_dtype"] is not None:
        out["cache_dtype"] = torch_dtype_name(out["cache_dtype"])
    if use_muon is not None and "initial_lr" in group:
        out["initial_lr"] = group["initial_lr"]
    out["use_muon"] = True
    return out


def adamw_group(group: dict[str, Any], use_muon: bool | None, adamw_defaults: dict[str, Any]) -> dict[str, Any]:
    """The complete AdamW group for a user group: adamw_* keys, or the plain AdamW keys of a
    use_muon=False group, over the constructor's adamw_* defaults. A mixed group's ``lr`` and
    ``eps`` are Muon's; only ``betas`` (which Muon has not) also names AdamW's."""
    out: dict[str, Any] = {}
    for k in ADAMW_KEYS:
        alias = f"adamw_{k}"
        if alias in group and k in group and k == "betas":
            raise ValueError(BETAS_TWICE)
        if alias in group:
            out[k] = group[alias]
        elif k in group and (use_muon is False or k == "betas"):
            out[k] = group[k]
        else:
            out[k] = adamw_defaults[k]
    out["betas"] = tuple(out["betas"]) if isinstance(out["betas"], list) else out["betas"]
    if use_muon is not None and "initial_lr" in group:
        out["initial_lr"] = group["initial_lr"]
    out["use_muon"] = False
    return out

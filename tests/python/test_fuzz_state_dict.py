"""Fuzz test of load_state_dict(): mutated state dicts (missing keys, wrong shapes and dtypes,
NaN and Inf, huge numbers, wrong types, truncated files). Every case is loaded or refused with a
clear error (ValueError, TypeError or KeyError; a truncated file fails in torch.load before
anything reaches the optimizer); a refused state dict loads nothing, and an accepted one leaves a
state that steps to finite weights. The mutations are random but seeded: a failure names its
case and reproduces."""

from __future__ import annotations

import copy
import io
import math
import random
from typing import Any

import torch

from distmuon.torch import Muon
from helpers import TinyGPT, train

CASES = 1000
CLEAR_ERRORS = (ValueError, TypeError, KeyError)


def odd_value(rng: random.Random, like: Any) -> Any:
    """A value that does not belong where `like` was."""
    pool: list[Any] = [None, "text", -1, 0, 10**30, 1e308, math.nan, math.inf, -math.inf, [], {}, (1, 2), True]
    if isinstance(like, torch.Tensor) and like.numel() > 0:
        t = like.detach().clone()
        pool += [
            t.reshape(-1)[:-1] if t.numel() > 1 else torch.zeros(2),  # wrong size
            torch.zeros(0),
            t.unsqueeze(0).expand(2, *t.shape).clone(),  # twice the elements
            t.to(torch.int64),
            t.to(torch.bool),
            t.to(torch.complex64),
            t.to(torch.float16),  # another float dtype: accepted
            t.t().contiguous() if t.ndim == 2 else t.reshape(-1),  # same numel, other shape
            torch.full_like(t, math.nan),
            torch.full_like(t, 3e38),
            torch.tensor(float(rng.choice([math.nan, math.inf, -1.0, 0.5, 1e20]))),
        ]
        poisoned = t.clone()
        poisoned.reshape(-1)[rng.randrange(t.numel())] = rng.choice([math.nan, math.inf, -math.inf])
        pool.append(poisoned)
    return rng.choice(pool)


def containers(node: Any, out: list[Any]) -> None:
    if isinstance(node, (dict, list)):
        out.append(node)
        for v in node.values() if isinstance(node, dict) else node:
            containers(v, out)


def mutate(sd: dict[str, Any], rng: random.Random) -> Any:
    sd = copy.deepcopy(sd)
    for _ in range(rng.randint(1, 3)):
        nodes: list[Any] = []
        containers(sd, nodes)
        node = rng.choice(nodes)
        if not node:
            continue
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        kind = rng.randrange(5)
        if kind == 0:  # a missing key or element
            del node[key]
        elif kind == 1 and isinstance(node, dict):  # a renumbered or huge parameter index
            node[rng.choice([10**18, -1, "0", key])] = node.pop(key)
        elif kind == 2 and isinstance(node, list):  # an extra element
            node.append(copy.deepcopy(node[key]))
        else:
            node[key] = odd_value(rng, node[key])
    return sd


def truncated(sd: dict[str, Any], rng: random.Random) -> Any:
    buf = io.BytesIO()
    torch.save(sd, buf)
    data = buf.getvalue()
    return torch.load(io.BytesIO(data[: rng.randrange(len(data))]), weights_only=True)


def snapshot(opt: Muon) -> tuple[Any, Any]:
    sd = opt.state_dict()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    return copy.deepcopy(sd["state"]), copy.deepcopy(groups)


def same(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    (sa, ga), (sb, gb) = a, b
    if ga != gb or sa.keys() != sb.keys():
        return False
    return all(sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa)


def test_mutated_state_dicts_are_loaded_or_refused_cleanly() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = Muon(model, lr=0.02, cache_gamma=0.1, adamw_lr=3e-3)  # CacheMuon entries are in it too
    train(model, [opt], 2)
    good = copy.deepcopy(opt.state_dict())
    rng = random.Random(16)
    loaded = refused = unreadable = 0
    for case in range(CASES):
        opt.load_state_dict(good)
        before = snapshot(opt)
        try:
            sd = truncated(good, rng) if case % 10 == 0 else mutate(good, rng)
        except Exception:  # noqa: BLE001 - torch.load refused a truncated file: nothing to load
            unreadable += 1
            continue
        try:
            opt.load_state_dict(sd)
        except CLEAR_ERRORS as e:
            refused += 1
            assert str(e), f"case {case}: empty message"
            assert same(snapshot(opt), before), f"case {case}: a refused state dict changed the state ({e})"
            continue
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"case {case}: unclear error {type(e).__name__}: {e}") from e
        loaded += 1
        for st in opt.state_dict()["state"].values():
            for k, v in st.items():
                assert torch.isfinite(v).all(), f"case {case}: loaded non-finite '{k}'"
    print(f"[fuzz] {CASES} state dicts: {loaded} loaded, {refused} refused, {unreadable} truncated files unreadable")
    assert loaded + refused + unreadable == CASES
    assert refused > CASES // 3 and loaded > 20
    # After all that, the optimizer still steps from the good state to finite weights.
    opt.load_state_dict(good)
    train(model, [opt], 1, first_step=2)
    assert all(torch.isfinite(p).all() for p in model.parameters())

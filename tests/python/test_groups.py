"""Who gets Muon, how groups are formed, and option validation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distmuon.torch import Muon, is_embedding_or_head_name
from helpers import TinyGPT, gpt_loss, train


def muon_names(opt: Muon) -> set[str]:
    return {n for g in opt.param_groups if g["use_muon"] for n in g["param_names"]}


def test_model_split_excludes_embeddings_head_and_vectors() -> None:
    opt = Muon(TinyGPT())
    assert muon_names(opt) == {"qkv.weight", "proj.weight", "fc.weight", "out_proj.weight"}
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    adamw = set(opt.param_groups[1]["param_names"])
    assert {"wte.weight", "wpe.weight", "lm_head.weight", "ln.weight", "qkv.bias"} <= adamw


def test_embedding_detected_by_module_type_whatever_its_name() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    opt = Muon(model)
    assert muon_names(opt) == {"1.weight"}  # '0.weight' has no telling name but is an nn.Embedding


def test_parametrized_embeddings_heads_and_convs_keep_their_role() -> None:
    # spectral_norm / weight_norm store a weight as '<module>.parametrizations.weight.original[N]':
    # the embedding and the head used to get Muon through that name and owner.
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = spectral_norm(nn.Embedding(10, 8))
            self.conv = weight_norm(nn.Conv2d(8, 8, 3))
            self.fc = nn.Linear(8, 8)
            self.head = weight_norm(nn.Linear(8, 10))

    opt = Muon(Net())
    # the conv's direction v is one 8 x 72 matrix; its per-channel scale g is a vector
    assert muon_names(opt) == {"conv.parametrizations.weight.original1", "fc.weight"}
    assert is_embedding_or_head_name("head.parametrizations.weight.original1")
    assert not is_embedding_or_head_name("blocks.0.fc.parametrizations.weight.original")


def test_named_parameters_use_name_heuristics() -> None:
    opt = Muon(TinyGPT().named_parameters())
    assert "wte.weight" not in muon_names(opt) and "lm_head.weight" not in muon_names(opt)
    assert "qkv.weight" in muon_names(opt)


@pytest.mark.parametrize(
    ("name", "excluded"),
    [
        ("transformer.wte.weight", True),
        ("model.embed_tokens.weight", True),
        ("lm_head.weight", True),
        ("output.weight", True),
        ("head.weight", True),
        ("pos_embed", True),
        ("encoder.layer.0.attention.output.dense.weight", False),  # 'output' is not the owner
        ("transformer.h.0.attn.c_attn.weight", False),
        ("layers.3.mlp.down_proj.weight", False),
    ],
)
def test_name_heuristic(name: str, excluded: bool) -> None:
    assert is_embedding_or_head_name(name) is excluded


def test_predicate_overrides_the_default() -> None:
    opt = Muon(TinyGPT(), muon_filter=lambda name, p: name == "lm_head.weight")
    assert muon_names(opt) == {"lm_head.weight"}


def test_predicate_may_not_give_vectors_to_muon() -> None:
    with pytest.raises(ValueError, match=r"'ln.weight' has shape \(16,\).*give it AdamW"):
        Muon(TinyGPT(), muon_filter=lambda name, p: True)


def test_plain_parameters_warn_that_names_are_missing() -> None:
    with pytest.warns(UserWarning, match="without names"):
        opt = Muon(TinyGPT().parameters())
    assert sum(len(g["params"]) for g in opt.param_groups if g["use_muon"]) == 7  # every matrix
    assert "param_names" not in opt.param_groups[0]


@pytest.mark.filterwarnings("ignore:distmuon.torch.Muon got parameters without names")
def test_explicit_groups_and_mixed_group_split() -> None:
    model = TinyGPT()
    opt = Muon(
        [
            {"params": [model.qkv.weight, model.proj.weight], "use_muon": True, "lr": 0.05, "ns_steps": 6},
            {"params": [model.wte.weight], "use_muon": False, "lr": 1e-2, "betas": (0.8, 0.9)},
            {"params": [model.fc.weight, model.fc.bias], "adamw_lr": 7e-4, "lr": 0.03},
        ],
        lr=0.02,
        adamw_lr=1e-3,
    )
    groups = opt.param_groups
    assert [g["use_muon"] for g in groups] == [True, False, True, False]
    assert groups[0]["lr"] == 0.05 and groups[0]["ns_steps"] == 6
    assert groups[1]["lr"] == 1e-2 and groups[1]["betas"] == (0.8, 0.9) and groups[1]["eps"] == 1e-8
    assert groups[2]["lr"] == 0.03 and groups[2]["params"] == [model.fc.weight]
    assert groups[3]["lr"] == 7e-4 and groups[3]["params"] == [model.fc.bias]
    assert set(groups[1]) == {"params", "use_muon", "lr", "betas", "eps", "weight_decay"}


def test_adamw_part_has_torch_adamw_defaults_whatever_lr_is() -> None:
    opt = Muon(TinyGPT(), lr=0.02, weight_decay=0.2, eps=1e-6)
    muon, adamw = opt.param_groups
    assert muon["lr"] == 0.02 and muon["weight_decay"] == 0.2 and muon["eps"] == 1e-6
    ref = torch.optim.AdamW([torch.zeros(1)]).defaults
    assert {k: adamw[k] for k in ("lr", "betas", "eps", "weight_decay")} == {
        k: ref[k] for k in ("lr", "betas", "eps", "weight_decay")
    }
    # a mixed group's lr is Muon's too
    model = TinyGPT()
    opt = Muon([{"params": list(model.named_parameters()), "lr": 0.05}], lr=0.02)
    assert [(g["use_muon"], g["lr"]) for g in opt.param_groups] == [(True, 0.05), (False, 1e-3)]
    with pytest.raises(TypeError, match="adamw_lr must be a number"):
        Muon(TinyGPT(), adamw_lr=None)  # type: ignore[arg-type]


def test_betas_as_torch_adamw_names_them() -> None:
    opt = Muon(TinyGPT(), lr=0.02, betas=(0.8, 0.95))
    assert opt.param_groups[1]["betas"] == (0.8, 0.95)
    assert opt.param_groups[0]["eps"] == 1e-7  # eps stays torch.optim.Muon's
    with pytest.raises(ValueError, match="betas and adamw_betas both set"):
        Muon(TinyGPT(), betas=(0.8, 0.95), adamw_betas=(0.9, 0.95))
    model = TinyGPT()
    with pytest.raises(ValueError, match="betas and adamw_betas both set"):
        Muon([{"params": list(model.named_parameters()), "betas": (0.8, 0.9), "adamw_betas": (0.9, 0.9)}])


def test_add_param_group_after_steps_keeps_state() -> None:
    model = TinyGPT()
    extra = nn.Linear(16, 16)
    opt = Muon([p for n, p in model.named_parameters()], lr=0.02, muon_filter=lambda n, p: p.ndim == 2)
    train(model, [opt], 2)
    before = opt.state[model.qkv.weight]["momentum_buffer"].clone()
    opt.add_param_group({"params": list(extra.parameters())})
    assert torch.equal(opt.state[model.qkv.weight]["momentum_buffer"], before)
    assert opt.state_dict()["state"][2]["step"] == 2
    train(model, [opt], 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr": -1.0}, ValueError, "lr must be >= 0"),
        ({"momentum": 1.0}, ValueError, r"momentum must be in \[0, 1\)"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay must be >= 0"),
        ({"ns_steps": 0}, ValueError, r"ns_steps must be an integer in \[1, 100\]"),
        ({"ns_steps": 101}, ValueError, r"ns_steps must be an integer in \[1, 100\]"),
        ({"eps": 0.0}, ValueError, "eps must be > 0"),
        ({"adjust_lr_fn": "bogus"}, ValueError, "adjust_lr_fn 'bogus'"),
        ({"ns_coefficients": (1.0, 2.0)}, ValueError, "ns_coefficients must be"),
        ({"ns_coefficients": "magic"}, ValueError, "unknown ns_coefficients 'magic'"),
        ({"algorithm": "svd"}, ValueError, "unknown algorithm 'svd'"),
        ({"algorithm": "ns7"}, ValueError, "runs 7 steps but ns_steps=5"),
        ({"ns_dtype": torch.int8}, ValueError, "unsupported dtype"),
        ({"adamw_betas": (0.9, 1.0)}, ValueError, r"betas must be in \[0, 1\)"),
        ({"adamw_eps": -1.0}, ValueError, "eps must be > 0"),
        ({"nesterov": 1}, TypeError, "nesterov must be a bool"),
        ({"momentum_dtype": torch.float16}, ValueError, "momentum_dtype"),
        ({"nonfinite": "ignore"}, ValueError, "nonfinite must be"),
        ({"cache_gamma": -2.0}, ValueError, "cache_gamma must be a positive number"),
        ({"cache_gamma": 5.0, "cache_probes": 5000}, ValueError, "cache_probes must be None"),
    ],
)
def test_bad_options_are_rejected_with_clear_messages(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Muon(TinyGPT(), **kwargs)


def test_unknown_group_key_is_an_error() -> None:
    model = TinyGPT()
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['betas'\] for a Muon group"):
        Muon([{"params": [model.qkv.weight], "use_muon": True, "betas": (0.9, 0.9)}])
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['lrr'\]"):
        Muon([{"params": [model.qkv.weight], "lrr": 0.1}])


def test_named_coefficient_sets_and_per_step_rows_train() -> None:
    for coeffs in ["polar-express", "you", [(3.4445, -4.775, 2.0315), (3.0, -3.2, 1.2)]]:
        torch.manual_seed(0)
        model = TinyGPT()
        losses = train(model, [Muon(model, lr=0.02, ns_coefficients=coeffs)], 5)
        assert losses[-1] < losses[0]


def test_engine_stats_count_matrices_and_work() -> None:
    model = TinyGPT()
    opt = Muon(model, lr=0.02)
    train(model, [opt], 3)
    st = opt.engine_stats()
    assert st["steps"] == 3 and st["muon_matrices"] == 4 and st["ortho_matrices"] == 12
    assert st["muon_params"] == sum(p.numel() for g in opt.param_groups if g["use_muon"] for p in g["params"])
    assert st["ortho_flops"] > 0 and st["nonfinite_skips"] == 0
    # The engine's own memory (momentum at least: f32, one element per Muon parameter), beside
    # PyTorch's allocator; stats() says it too.
    assert st["memory_peak_bytes"] >= st["memory_bytes"] >= 4 * st["muon_params"]
    assert opt.stats()["memory_bytes"] == st["memory_bytes"]
    # The host's share of the last step: positive (a step was issued), and far below a second.
    assert 0 < st["issue_ms"] < 1000 and opt.stats()["issue_ms"] == st["issue_ms"]


def test_closure_is_evaluated_with_grad() -> None:
    model = TinyGPT()
    opt = Muon(model, lr=0.02)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = gpt_loss(model, 0)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad

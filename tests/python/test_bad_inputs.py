"""Bad input: consistent skips or clear errors, and never a half-applied step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distmuon.torch import Muon
from helpers import TinyGPT, clone, gpt_loss, max_param_diff, train


needs_grad_dtype = pytest.mark.skipif(
    not hasattr(torch.Tensor, "grad_dtype"), reason="this torch ties a gradient's dtype to its parameter's"
)


def make(model: nn.Module, **kw: object) -> Muon:
    return Muon(model, **{"lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3, **kw})  # type: ignore[arg-type]


def state_copy(opt: Muon) -> list[dict[str, torch.Tensor]]:
    opt.state_dict()  # refreshes "step"
    return [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


def assert_untouched(model: nn.Module, before: nn.Module, opt: Muon, state: list[dict[str, torch.Tensor]]) -> None:
    assert max_param_diff(model, before) == 0.0
    after = state_copy(opt)
    for a, b in zip(state, after):
        for k in a:
            assert torch.equal(a[k], b[k]), k


def backward(model: nn.Module, opt: Muon, step: int = 0) -> None:
    opt.zero_grad()
    gpt_loss(model, step).backward()


def test_grad_none_parameters_are_skipped_entirely() -> None:
    model = TinyGPT()
    opt = make(model, weight_decay=0.5)
    train(model, [opt], 1)
    backward(model, opt, 1)
    model.fc.weight.grad = None  # a Muon matrix
    model.ln.weight.grad = None  # an AdamW vector
    fc, ln = model.fc.weight.detach().clone(), model.ln.weight.detach().clone()
    fc_mom = opt.state[model.fc.weight]["momentum_buffer"].clone()
    qkv = model.qkv.weight.detach().clone()
    opt.step()
    assert torch.equal(model.fc.weight, fc) and torch.equal(model.ln.weight, ln)  # no decay either
    assert torch.equal(opt.state[model.fc.weight]["momentum_buffer"], fc_mom)
    assert not torch.equal(model.qkv.weight, qkv)
    steps = opt.state_dict()["state"]
    names = [n for g in opt.param_groups for n in g["param_names"]]
    assert steps[names.index("fc.weight")]["step"] == 1 and steps[names.index("qkv.weight")]["step"] == 2


def test_all_grads_none_is_a_no_op() -> None:
    model = TinyGPT()
    opt = make(model)
    before, state = clone(model), state_copy(opt)
    opt.step()
    assert_untouched(model, before, opt, state)


def test_sparse_gradient_is_an_error_and_nothing_moves() -> None:
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 1)
    backward(model, opt)
    model.wte.weight.grad = model.wte.weight.grad.to_sparse()
    before, state = clone(model), state_copy(opt)
    with pytest.raises(RuntimeError, match="'wte.weight' has a sparse gradient"):
        opt.step()
    assert_untouched(model, before, opt, state)


def test_sparse_embedding_module_is_refused_at_step() -> None:
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Muon(emb, lr=0.01)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradient"):
        opt.step()


def test_complex_parameters_are_refused_at_construction() -> None:
    with pytest.raises(TypeError, match="'z' is complex"):
        Muon([("z", nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64)))])


def test_integer_and_empty_parameters_are_refused() -> None:
    with pytest.raises(TypeError, match="'i' has dtype torch.int64"):
        Muon([("i", torch.zeros(3, 3, dtype=torch.int64))])
    with pytest.raises(ValueError, match="'e' is empty"):
        Muon([("e", nn.Parameter(torch.zeros(0, 3)))])


def test_non_contiguous_gradient_gives_the_contiguous_result() -> None:
    torch.manual_seed(0)
    model = TinyGPT()
    twin = clone(model)
    opt, opt2 = make(model), make(twin)
    for m, o, transposed in ((model, opt, False), (twin, opt2, True)):
        backward(m, o)
        if transposed:
            g = m.fc.weight.grad
            m.fc.weight.grad = g.t().contiguous().t()  # same values, column-major strides
            assert not m.fc.weight.grad.is_contiguous()
        o.step()
    assert max_param_diff(model, twin) == 0.0


def test_mismatched_gradient_shape_is_an_error_before_any_update() -> None:
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 1)
    backward(model, opt)
    # torch checks shapes on .grad assignment but not through .grad.set_(): a gradient with the
    # parameter's numel and another shape, on the LAST parameter, so that a half-applied step
    # would show on the others.
    last = opt.param_groups[-1]["params"][-1]
    last.grad.set_(last.grad.reshape(-1, 1) if last.ndim == 1 else last.grad.reshape(-1))
    before, state = clone(model), state_copy(opt)
    with pytest.raises(ValueError, match="has shape"):
        opt.step()
    assert_untouched(model, before, opt, state)


@needs_grad_dtype
def test_wrong_dtype_gradient_is_an_error_before_any_update() -> None:
    model = TinyGPT()
    opt = make(model)
    backward(model, opt)
    model.out_proj.bias.grad_dtype = None  # torch then accepts a gradient of any dtype
    model.out_proj.bias.grad = model.out_proj.bias.grad.to(torch.int32)  # a later parameter
    before, state = clone(model), state_copy(opt)
    with pytest.raises(ValueError, match="gradient of parameter 'out_proj.bias' has an unsupported dtype"):
        opt.step()
    assert_untouched(model, before, opt, state)


@needs_grad_dtype
def test_gradients_of_another_float_dtype_are_used_as_they_are() -> None:
    """bf16 gradients of fp32 parameters (grad_dtype=None): the engine reads them directly."""
    torch.manual_seed(0)
    model = TinyGPT()
    twin = clone(model)
    opt, opt2 = make(model), make(twin)
    backward(model, opt)
    backward(twin, opt2)
    for p, q in zip(model.parameters(), twin.parameters()):
        p.grad = p.grad.to(torch.bfloat16).float()  # the values bf16 can hold
        q.grad_dtype = None
        q.grad = p.grad.to(torch.bfloat16)
    opt.step()
    opt2.step()
    assert max_param_diff(model, twin) == 0.0


def test_parameter_changed_after_construction_is_an_error() -> None:
    model = TinyGPT()
    opt = make(model)
    model.double()
    backward(model, opt)
    with pytest.raises(ValueError, match="parameter 'qkv.weight' is f64 but was registered as f32"):
        opt.step()
    model.float()
    model.fc.weight.data = torch.zeros(8, 8)
    with pytest.raises(RuntimeError, match=r"'fc.weight' now has shape \(8, 8\)"):
        opt.step()


def test_non_contiguous_parameter_is_an_error() -> None:
    model = TinyGPT()
    opt = make(model)
    backward(model, opt)
    model.fc.weight.data = model.fc.weight.data.t().contiguous().t()
    with pytest.raises(ValueError, match="parameter 'fc.weight' is not contiguous"):
        opt.step()


def test_channels_last_weights_are_refused_at_construction() -> None:
    # Before, construction accepted them and every step() raised; now the error comes first and
    # says what makes a weight so and what to do.
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 4))
    model = model.to(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match=r"parameter '0.weight' is not contiguous .*channels_last"):
        Muon(model)
    model = model.to(memory_format=torch.contiguous_format)
    Muon(model)  # contiguous again: accepted


def test_mixed_devices_are_refused() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    with pytest.raises(ValueError, match="several devices"):
        Muon([("a", nn.Parameter(torch.zeros(2, 2))), ("b", nn.Parameter(torch.zeros(2, 2, device="cuda")))])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_is_skipped_per_tensor_and_counted(bad: float) -> None:
    model = TinyGPT()
    opt = make(model)
    train(model, [opt], 1)
    backward(model, opt)
    model.fc.weight.grad[0, 0] = bad
    model.ln.bias.grad[0] = bad
    fc, ln = model.fc.weight.detach().clone(), model.ln.bias.detach().clone()
    mom = opt.state[model.fc.weight]["momentum_buffer"].clone()
    qkv = model.qkv.weight.detach().clone()
    opt.step()
    assert torch.equal(model.fc.weight, fc) and torch.equal(model.ln.bias, ln)
    assert torch.equal(opt.state[model.fc.weight]["momentum_buffer"], mom)
    assert not torch.equal(model.qkv.weight, qkv)
    assert torch.isfinite(torch.cat([p.detach().flatten() for p in model.parameters()])).all()
    assert opt.engine_stats()["nonfinite_skips"] == 2


def test_nonfinite_gradient_with_raise_policy_touches_nothing() -> None:
    model = TinyGPT()
    opt = make(model, nonfinite="raise")
    train(model, [opt], 1)
    backward(model, opt)
    model.lm_head.weight.grad[3, 1] = float("nan")
    before, state = clone(model), state_copy(opt)
    with pytest.raises(RuntimeError, match="non-finite gradient .*'lm_head.weight'.*not applied"):
        opt.step()
    assert_untouched(model, before, opt, state)


def test_zero_gradient_only_decays() -> None:
    model = TinyGPT()
    opt = make(model, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    w = model.qkv.weight.detach().clone()
    opt.step()
    torch.testing.assert_close(model.qkv.weight.detach(), w * (1 - 0.02 * 0.5), rtol=0, atol=1e-7)


def test_a_parameter_listed_twice_in_one_group_is_refused() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="lists one parameter twice \\('a' and 'a2'\\)"):
        Muon([("a", w), ("a2", w)], lr=0.02)
    with pytest.raises(ValueError, match="lists one parameter twice \\(positions 0 and 1\\)"):
        Muon([{"params": [w, w], "use_muon": True}], lr=0.02)


def test_options_of_the_wrong_kind_are_refused_in_one_process() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(TypeError, match="cuda_graphs must be True or False"):
        Muon([w], cuda_graphs="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="communicator must be one of"):
        Muon([w], communicator="bogus")
    with pytest.raises(TypeError, match="bucket_mb must be a number"):
        Muon([w], bucket_mb="32")  # type: ignore[arg-type]
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="bucket_mb must be a finite number"):
            Muon([w], bucket_mb=bad)
    for bad in (torch.float16, torch.float32, "bf16"):
        with pytest.raises(ValueError, match="wire_dtype must be None or torch.bfloat16"):
            Muon([w], wire_dtype=bad)  # type: ignore[arg-type]


def test_copying_the_optimizer_is_refused_clearly() -> None:
    import copy
    import pickle

    opt = Muon([torch.nn.Parameter(torch.randn(8, 8))], lr=0.02)
    for copier in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled.*state_dict"):
            copier(opt)

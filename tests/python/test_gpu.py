"""CUDA: the backend follows the parameters' device. Skipped without a GPU (and, for the
numerical tests, without distmuon's CUDA backend)."""

from __future__ import annotations

import copy

import pytest
import torch

import distmuon
from distmuon.torch import Muon
from helpers import TinyGPT, clone, gpt_loss, make_batch, max_param_diff, muon_and_adamw_params

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
needs_backend = pytest.mark.skipif(not distmuon.cuda_available(), reason="distmuon built without CUDA")

STEPS = 10


def gpt_loss_on(model: torch.nn.Module, step: int, device: str) -> torch.Tensor:
    """helpers.gpt_loss with the batch and positions on `device`."""
    x, y = make_batch(step)
    x, y = x.to(device), y.to(device)
    pos = torch.arange(x.shape[1], device=device)
    h = model.wte(x) + model.wpe(pos)
    h = h + model.proj(torch.tanh(model.qkv(model.ln(h))))
    h = h + model.out_proj(torch.nn.functional.gelu(model.fc(h)))
    logits = model.lm_head(h)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def run(model: torch.nn.Module, opts: list[torch.optim.Optimizer], device: str, stream: bool = False) -> None:
    s = torch.cuda.Stream() if stream else torch.cuda.current_stream()
    with torch.cuda.stream(s):
        for step in range(STEPS):
            for o in opts:
                o.zero_grad()
            gpt_loss_on(model, step, device).backward()
            for o in opts:
                o.step()
    torch.cuda.synchronize()


def test_cuda_parameters_without_cuda_backend_are_refused_clearly() -> None:
    if distmuon.cuda_available():
        pytest.skip("this build has the CUDA backend")
    with pytest.raises(RuntimeError, match="no CUDA backend"):
        Muon(TinyGPT().cuda())


@needs_backend
def test_cuda_fp32_iteration_equals_cpu() -> None:
    torch.manual_seed(0)
    cpu = TinyGPT()
    gpu = copy.deepcopy(cpu).cuda()
    kw = {"lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3, "ns_dtype": torch.float32}
    opt_cpu = Muon(cpu, **kw)
    for step in range(STEPS):
        opt_cpu.zero_grad()
        gpt_loss(cpu, step).backward()
        opt_cpu.step()
    run(gpu, [Muon(gpu, **kw)], "cuda")
    assert max_param_diff(cpu, gpu.cpu()) < 1e-4  # fp32 products on different hardware (TF32 off)


@needs_backend
@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_bf16_close_to_torch_muon(side_stream: bool) -> None:
    torch.manual_seed(1)
    model = TinyGPT().cuda()
    ref = clone(model)
    hidden, rest = muon_and_adamw_params(ref)
    ref_opts = [
        torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1),
        torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.01),
    ]
    run(ref, ref_opts, "cuda")
    run(model, [Muon(model, lr=0.02, weight_decay=0.1, adamw_lr=3e-3, algorithm="ns")], "cuda", side_stream)
    assert max_param_diff(model, ref) < 5e-3  # both iterate in bf16 (see test_equivalence.py)


@needs_backend
@pytest.mark.parametrize("cache", [False, True])
def test_the_step_follows_torch_work_on_the_default_stream(cache: bool) -> None:
    """torch's default stream is the legacy stream (handle 0). The engine must issue on it, not
    on a stream of its own: here the gradient is written by a kernel queued behind a 200 ms spin
    on the default stream and step() is called at once, without a synchronisation."""
    torch.manual_seed(3)
    kw = {"lr": 0.02, "ns_dtype": torch.float32, "algorithm": "gram-ns" if cache else "ns5"}
    if cache:
        kw["cache_gamma"] = 5.0
    models = [torch.nn.Linear(256, 512, bias=False).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [Muon(m, **kw) for m in models]
    for step in range(3):
        g = torch.randn(512, 256, device="cuda")
        for k, (m, o) in enumerate(zip(models, opts)):
            m.weight.grad = torch.zeros_like(m.weight)
            torch.cuda.synchronize()
            if k == 0:
                torch.cuda._sleep(int(2e8))  # ~0.1-0.2 s of spinning on the default stream
            m.weight.grad.copy_(g)  # queued behind the spin
            o.step()
            torch.cuda.synchronize()
    assert torch.equal(models[0].weight, models[1].weight)


@needs_backend
def test_cuda_graph_steps_equal_issued_steps_under_a_scheduler() -> None:
    """cuda_graphs: the step is captured once its buffers repeat and replayed from then on; with a
    scheduler changing the learning rate every step (and weight decay and momentum by hand), the
    replayed steps equal eagerly issued ones bit for bit."""
    torch.manual_seed(5)
    base = TinyGPT().cuda()
    models = [copy.deepcopy(base) for _ in range(2)]
    kw = {"lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3}
    opts = [Muon(m, cuda_graphs=graphs, **kw) for m, graphs in zip(models, (True, False))]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]
    for step in range(8):
        for m, o, sc in zip(models, opts, scheds):
            o.zero_grad(set_to_none=False)  # the same gradient buffers every step
            gpt_loss_on(m, step, "cuda").backward()
            for g in o.param_groups:
                if g.get("use_muon"):
                    g["weight_decay"] = 0.1 + 0.01 * step
                    g["momentum"] = 0.9 + 0.005 * step
            o.step()
            sc.step()
    torch.cuda.synchronize()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    graphed, eager = (o.stats() for o in opts)
    assert graphed["graph_captures"] == 1 and graphed["graph_replays"] == 6
    assert eager["graph_captures"] == 0 and eager["graph_replays"] == 0


@needs_backend
def test_cuda_state_lives_on_the_device_and_round_trips() -> None:
    model = TinyGPT().cuda()
    opt = Muon(model, lr=0.02)
    run(model, [opt], "cuda")
    sd = copy.deepcopy(opt.state_dict())
    assert sd["state"][0]["momentum_buffer"].is_cuda
    opt2 = Muon(clone(model), lr=0.02)
    opt2.load_state_dict(sd)
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"], sd["state"][0]["momentum_buffer"])


# ---- distributed on one GPU: the NCCL communicator through the front ----------------------------


@pytest.fixture
def nccl_world_of_one() -> object:
    """torch.distributed over NCCL with one rank (the GPU machine has one GPU)."""
    import torch.distributed as dist

    from dist_harness import free_port

    if not distmuon._C.nccl_available():
        pytest.skip("distmuon built without NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


class DeviceGPT(TinyGPT):
    """TinyGPT whose forward makes its positions on the input's device (FSDP2 needs the
    module's own forward: its hooks gather the parameters)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        h = h + self.proj(torch.tanh(self.qkv(self.ln(h))))
        h = h + self.out_proj(torch.nn.functional.gelu(self.fc(h)))
        return self.lm_head(h)


def train_cuda(model: torch.nn.Module, opt: torch.optim.Optimizer, side_stream: bool) -> None:
    s = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    with torch.cuda.stream(s):
        for step in range(STEPS):
            opt.zero_grad()
            x, y = (t.cuda() for t in make_batch(step))
            logits = model(x)
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            opt.step()
    torch.cuda.synchronize()


@needs_backend
@pytest.mark.parametrize("kind", ["fsdp2", "ddp"])
def test_nccl_world_of_one_equals_single_gpu(nccl_world_of_one: object, kind: str) -> None:
    """The sharded (FSDP2) and replicated (DDP) modes over the engine's NCCL communicator, with
    the steps issued on a side stream (the communicator stays on the stream it was made for;
    events order the two), give the single-GPU optimizer's weights."""
    torch.manual_seed(6)
    base = DeviceGPT().cuda()
    kw = {"lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3, "ns_dtype": torch.float32}
    ref = clone(base)
    train_cuda(ref, Muon(ref, **kw), side_stream=False)
    model = clone(base)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cuda", (1,)))
        opt = Muon(model, **kw)
        assert opt.dist_mode == "sharded"
    else:
        opt = Muon(model, dist_mode="replicated", **kw)
        assert opt.dist_mode == "replicated"
    comm = opt._parts[0].comm
    assert comm is not None and comm.name.startswith("nccl")
    train_cuda(model, opt, side_stream=True)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    diff = max((full[n] - q.detach()).abs().max().item() for n, q in ref.named_parameters())
    assert diff < 1e-5
    sd = opt.state_dict()  # momentum gathered from its owner over NCCL
    assert all(torch.isfinite(torch.as_tensor(st["step"])) for st in sd["state"].values())


@needs_backend
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("fsdp", [True, False])
def test_dedicated_world_of_one_equals_single_gpu(nccl_world_of_one: object, overlap: bool, fsdp: bool) -> None:
    """dedicate() on one GPU: nothing moves; with overlap_step the updates' momentum and
    orthogonalization run on a side stream during backward, the step applies them. The rest of
    the model plain or under FSDP2. Steps issued on a side stream of torch's as well."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from distmuon.torch import dedicate

    torch.manual_seed(7)
    base = DeviceGPT().cuda()
    kw = {"lr": 0.02, "weight_decay": 0.1, "adamw_lr": 3e-3, "ns_dtype": torch.float32}
    ref = clone(base)
    train_cuda(ref, Muon(ref, **kw), side_stream=False)
    model = clone(base)
    mesh = init_device_mesh("cuda", (1,))
    dm = dedicate(model, mesh, overlap_step=overlap)
    if fsdp:
        fully_shard(model, mesh=mesh, ignored_params=dm.ignored_params)
    opt = Muon(model, **kw)
    assert opt.dist_modes == ["dedicated", "sharded" if fsdp else "local"]
    train_cuda(model, opt, side_stream=True)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    diff = max((full[n] - q.detach()).abs().max().item() for n, q in ref.named_parameters())
    assert diff < 1e-5
    assert opt.engine_stats()["owned_matrices"] == 4
    assert dm.memory_stats()["held_bytes"] == dm.memory_stats()["total_bytes"]

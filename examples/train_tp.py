#!/usr/bin/env python3
"""A torchtitan-style Llama with tensor parallelism x FSDP2, or with an MoE block at expert
parallelism x FSDP2, trained by distmuon.torch.Muon on tinyshakespeare's characters.

    python examples/train_tp.py --tp 2 --dp 2            # 4 ranks: TP 2 x FSDP 2 (gloo on the CPU)
    python examples/train_tp.py --ep 2 --dp 2            # 4 ranks: an MoE FFN, experts split over ep
    python examples/train_tp.py --tp 2 --dp 2 --check    # ... and compare with one process
    torchrun --nproc-per-node 4 examples/train_tp.py --tp 2 --dp 2 --device cuda   # NCCL ranks

The optimizer lines are those of one process: ``Muon(model, ...)`` reads the parallelism from the
parameters (docs/distributed.md, "Tensor and expert parallelism"). Tensor and expert parallel
ranks see the same tokens (the batch is split over dp only); the MoE block computes its local
experts on every token and sums over ep (a real MoE dispatches tokens with an all-to-all, which
changes nothing for the optimizer). ``--check`` trains the same model on the same global batches
in one process afterwards and prints the largest parameter difference (float32 reduction order:
about 1e-6).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch: ranks share the cores

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from distmuon.torch import Muon  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under ColwiseParallel each tp rank holds heads / tp of them
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Reduce(torch.autograd.Function):
    """Sum over the ep group in forward, identity in backward (and _Copy the reverse): the two
    ends of a region split over ep (Megatron's g and f)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


class MoE(nn.Module):
    """A soft mixture of SwiGLU experts stacked in 3-D parameters (experts, rows, cols)."""

    def __init__(self, dim: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)
        self.ep_group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        w1, w2, w3 = self.w1, self.w2, self.w3
        if self.ep_group is not None:  # this rank's experts; the input's gradient summed over ep
            w1, w2, w3 = (w.to_local() for w in (w1, w2, w3))  # type: ignore[operator]
            first = dist.get_group_rank(self.ep_group, dist.get_rank()) * w1.shape[0]
            gates, x = _Copy.apply(gates, self.ep_group), _Copy.apply(x, self.ep_group)
            gates = gates[..., first : first + w1.shape[0]]
        h = F.silu(torch.einsum("btd,ehd->bteh", x, w1)) * torch.einsum("btd,ehd->bteh", x, w3)
        y = torch.einsum("bteh,edh,bte->btd", h, w2, gates)
        return _Reduce.apply(y, self.ep_group) if self.ep_group is not None else y


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.feed_forward = MoE(dim, hidden, experts) if experts else FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden, experts) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model: Llama, args: argparse.Namespace) -> tuple[int, int]:
    """torchtitan's layout: TP inside each block, experts split over ep, FSDP2 over dp.
    Returns this rank's data-parallel (index, size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    inner, name = (args.tp, "tp") if args.tp > 1 else (args.ep, "ep")
    mesh = init_device_mesh(args.device, (args.dp, inner), mesh_dim_names=("dp", name))
    for block in model.layers:
        if name == "tp":
            plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
            plan["attention.wo"] = RowwiseParallel()
            if not args.experts:
                plan.update({"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel()})
                plan["feed_forward.w2"] = RowwiseParallel()
            parallelize_module(block, mesh["tp"], plan)
        elif inner > 1:
            moe = block.feed_forward
            for w in ("w1", "w2", "w3"):
                setattr(moe, w, nn.Parameter(distribute_tensor(getattr(moe, w).data, mesh["ep"], [Shard(0)])))
            moe.ep_group = mesh["ep"].get_group()
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh.get_coordinate()[0], args.dp


def batch(text: torch.Tensor, step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(text) - args.seq - 1, (args.batch,), generator=g)
    chunks = torch.stack([text[s : s + args.seq + 1] for s in starts.tolist()])
    return chunks[:, :-1], chunks[:, 1:]


def train(args: argparse.Namespace, text: torch.Tensor, vocab: int, distributed: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    dev = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    model = Llama(vocab, args.dim, args.layers, args.heads, args.hidden, args.experts).to(dev)
    dp_rank, dp = parallelize(model, args) if distributed else (0, 1)
    opt = Muon(model, lr=0.02, weight_decay=0.005, adamw_lr=3e-3, **({} if distributed else {"dist_mode": "local"}))
    if distributed and dist.get_rank() == 0:
        print(f"optimizer: {opt.dist_mode} over {dist.get_world_size()} ranks")
    per = args.batch // dp
    for step in range(args.steps):
        x, y = batch(text, step, args)
        x, y = x[dp_rank * per : (dp_rank + 1) * per].to(dev), y[dp_rank * per : (dp_rank + 1) * per].to(dev)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if distributed:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        if (not distributed or dist.get_rank() == 0) and (step % 10 == 0 or step == args.steps - 1):
            print(f"{'one process' if not distributed else 'step'} {step:4d}  loss {loss.item():.4f}")
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu() for n, p in model.named_parameters()}


def rank_main(rank: int, args: argparse.Namespace, port: int | None) -> None:
    if port is not None:  # spawned by main(); torchrun sets the environment itself
        world = args.dp * max(args.tp, args.ep)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    text = torch.tensor(list(DATA.read_bytes()[:200_000]), dtype=torch.long)
    chars = torch.unique(text)
    text = torch.searchsorted(chars, text)
    params = train(args, text, len(chars), distributed=True)
    if args.check and dist.get_rank() == 0:
        reference = train(args, text, len(chars), distributed=False)
        diff = max((params[n] - reference[n]).abs().max().item() for n in params)
        print(f"largest parameter difference from one process: {diff:.2e}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=2, help="data-parallel (FSDP2) degree")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel degree (an MoE feed-forward)")
    ap.add_argument("--experts", type=int, default=0, help="experts per MoE block (default: 4 with --ep, else none)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over dp)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=176)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--check", action="store_true", help="compare with one process afterwards")
    args = ap.parse_args()
    if args.tp > 1 and args.ep > 1:
        ap.error("this example takes --tp or --ep, not both")
    if args.ep > 1 and not args.experts:
        args.experts = 4
    if args.experts and args.experts % args.ep:
        ap.error(f"--experts {args.experts} must be a multiple of --ep {args.ep}")
    if min(args.dp, args.tp, args.ep, args.steps) < 1 or args.batch % args.dp:
        ap.error("--dp, --tp, --ep, --steps must be >= 1 and --batch a multiple of --dp")
    if "RANK" in os.environ:  # under torchrun
        rank_main(int(os.environ["RANK"]), args, None)
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(args, port), nprocs=args.dp * max(args.tp, args.ep), start_method="spawn")


if __name__ == "__main__":
    main()

"""Language-model study: a GPT-2-small-shaped model (12 layers, width 768) trained at character
level on the shipped tinyshakespeare corpus, one run per optimizer arm, identical init and data.

    python bench/quality/lm.py --device cuda --steps 1500 --out out/quality-lm.json
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from train_gpt import CharData  # noqa: E402
from common import (ArmResult, Timer, cache_stats, record_cache, make_optimizer, ns5_flops, parse_arm,  # noqa: E402
                    save_results, step_all, zero_all)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


# The study's own GPT-2-style model (biased linears, GPT-2 init; the recorded results ran it),
# not examples/train_gpt.py's bias-free one.
class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.fc_proj = nn.Linear(4 * width, width)
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--arms", default="adamw:lr=6e-4,adamw:lr=1.5e-3,torch-muon,distmuon:algo=ns5,distmuon:algo=auto,distmuon:algo=gram-ns,"
                    "distmuon:algo=gram-ns:gamma=0.5,distmuon:algo=gram-ns:gamma=1,distmuon:algo=gram-ns:gamma=2,"
                    "distmuon:algo=gram-ns:gamma=5,distmuon:algo=gram-ns:gamma=15,"
                    "distmuon:algo=gram-ns:gamma=2:shadow=1,distmuon:algo=gram-ns:gamma=15:shadow=1")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adamw-lr", type=float, default=3e-3,
                    help="AdamW lr of the non-matrix parameters inside the Muon arms")
    ap.add_argument("--warmup", type=int, default=50, help="linear LR warm-up steps (every arm)")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "quality-lm.json"))
    args = ap.parse_args()

    device = torch.device(args.device)
    corpus = CharData(Path(ROOT) / "data" / "tinyshakespeare.txt", device)  # the example's 90/10 split
    train, val, vocab = corpus.train.to(device), corpus.val.to(device), corpus.vocab
    torch.manual_seed(args.seed)
    init = GPT(vocab, args.width, args.layers, args.heads, args.context).state_dict()
    gen = torch.Generator().manual_seed(args.seed + 1)
    batch_starts = torch.randint(0, len(train) - args.context - 1, (args.steps, args.batch), generator=gen)
    val_starts = torch.randint(0, len(val) - args.context - 1, (16, args.batch), generator=gen)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def batch(data, starts):
        x = torch.stack([data[s:s + args.context] for s in starts.tolist()])
        y = torch.stack([data[s + 1:s + 1 + args.context] for s in starts.tolist()])
        return x, y

    results = []
    for spec in args.arms.split(","):
        arm = parse_arm(spec)
        model = GPT(vocab, args.width, args.layers, args.heads, args.context).to(device)
        model.load_state_dict(init)
        opt = make_optimizer(arm, model, args.muon_lr, args.adamw_lr, args.weight_decay)
        # Same schedule for every arm: linear warm-up, cosine decay to 10 %.
        sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: min(1.0, (t + 1) / args.warmup) * (
            0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t / args.steps))))) for o in (opt if isinstance(opt, list) else [opt])]
        res = ArmResult(arm=spec, label=arm.label)
        muon_shapes = [p.shape for n, p in model.named_parameters()
                       if p.ndim >= 2 and not any(k in n for k in ("wte", "wpe", "lm_head"))]
        ns5_step = sum(ns5_flops(s[0], s[1]) for s in muon_shapes)
        t_start = time.time()
        prev_flops = 0.0
        for step in range(args.steps):
            model.train()
            x, y = batch(train, batch_starts[step])
            with autocast:
                loss = F.cross_entropy(model(x).float().view(-1, vocab), y.view(-1))
            loss.backward()
            with Timer(device) as t:
                step_all(opt)
            zero_all(opt)
            for sc in sched:
                sc.step()
            res.opt_ms.append(t.ms)
            st = cache_stats(opt)
            if st is not None:
                flops = float(st["ortho_flops"])
                res.ortho_flops.append(flops - prev_flops)
                prev_flops = flops
                record_cache(res, st)
            else:
                res.ortho_flops.append(ns5_step if arm.kind == "torch-muon" else 0.0)
            if step % args.eval_every == 0 or step == args.steps - 1:
                model.eval()
                with torch.no_grad(), autocast:
                    vl = sum(F.cross_entropy(model(vx).float().view(-1, vocab), vy.view(-1)).item()
                             for vx, vy in (batch(val, s) for s in val_starts)) / len(val_starts)
                res.steps.append(step)
                res.val.append(vl)
                res.train_loss.append(loss.item())
                print(f"[{arm.label}] step {step:5d}  train {loss.item():.4f}  val {vl:.4f}  "
                      f"opt {sum(res.opt_ms[-args.eval_every:]) / min(len(res.opt_ms), args.eval_every):.2f} ms",
                      flush=True)
        res.final = res.val[-1]
        res.wall_s = time.time() - t_start
        results.append(res)
        save_results(args.out, vars(args), results)
    print(f"\n{'arm':36s} {'final val':>10s} {'opt ms':>8s} {'ortho GF/step':>14s}")
    for r in results:
        n = len(r.opt_ms)
        opt_ms = sorted(r.opt_ms[n // 10:])[len(r.opt_ms[n // 10:]) // 2] if n else math.nan
        print(f"{r.label:36s} {r.final:10.4f} {opt_ms:8.2f} {sum(r.ortho_flops) / max(1, n) / 1e9:14.2f}")


if __name__ == "__main__":
    main()

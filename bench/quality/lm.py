"""Language-model study: a GPT trained at character level on the shipped tinyshakespeare corpus,
one run per optimizer arm and seed; every arm of a seed has the same initial weights and the same
batches (bench/quality/README.md: the sizes, why they do not overfit, the arms).

    python bench/quality/lm.py --size small --seeds 0,1 --out out/quality-lm-small.json
"""
from __future__ import annotations

import argparse
import hashlib
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
from common import (ArmResult, Timer, batch_plan, cache_stats, record_cache, make_optimizer, ns5_flops,  # noqa: E402
                    parse_arm, save_results, step_all, tensor_digest, zero_all)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# Model sizes sized to the corpus (1.0 M training characters; README.md has the arithmetic): a
# batch of 8 x 256 characters makes 490 steps an epoch; 'small' trains 1.96 epochs, 'medium'
# (GPT-2 small's shape, the matrices of the old study) 0.98, so no character is a target twice.
# 'tiny' is the CPU test's.
SIZES = {
    "tiny": dict(layers=2, width=64, heads=4, context=32, batch=4, steps=8, eval_every=4, warmup=2,
                 adamw_lrs=(1e-3,)),
    "small": dict(layers=6, width=384, heads=6, context=256, batch=8, steps=960, eval_every=80, warmup=50,
                  adamw_lrs=(1e-3, 2e-3, 4e-3)),
    "medium": dict(layers=12, width=768, heads=12, context=256, batch=8, steps=480, eval_every=40, warmup=30,
                   adamw_lrs=(3e-4, 6e-4, 1.2e-3)),
}
# The optimizer arms every size runs (besides AdamW at its size's learning rates; common.py
# parses them): the references, fresh Gram NS, CacheMuon's residual trigger at several gammas,
# the residual from 8 probes, the check back-off, and staleness schedules with the residual off.
MUON_ARMS = ("torch-muon", "distmuon:algo=gram-ns",
             "distmuon:algo=gram-ns:gamma=2", "distmuon:algo=gram-ns:gamma=5",
             "distmuon:algo=gram-ns:gamma=2:backoff=8", "distmuon:algo=gram-ns:gamma=5:backoff=8",
             "distmuon:algo=gram-ns:gamma=15", "distmuon:algo=gram-ns:gamma=30",
             "distmuon:algo=gram-ns:gamma=15:probes=8",
             "distmuon:algo=gram-ns:gamma=1e6:staleness=1", "distmuon:algo=gram-ns:gamma=1e6:staleness=3")


def default_arms(size: str) -> str:
    return ",".join([f"adamw:lr={lr:g}" for lr in SIZES[size]["adamw_lrs"]] + list(MUON_ARMS))


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


def evaluate(model, val, starts, context, vocab, autocast, device, chunk: int = 64) -> float:
    """Mean loss over fixed, non-overlapping validation windows (the same for every arm)."""
    model.eval()
    total = 0.0
    with torch.no_grad(), autocast:
        for i in range(0, len(starts), chunk):
            s = starts[i:i + chunk].tolist()
            x = torch.stack([val[j:j + context] for j in s]).to(device)
            y = torch.stack([val[j + 1:j + 1 + context] for j in s]).to(device)
            total += F.cross_entropy(model(x).float().view(-1, vocab), y.view(-1), reduction="sum").item()
    return total / (len(starts) * context)


def train_arm(spec: str, seed: int, args, corpus, val_starts, device) -> ArmResult:
    """One arm at one seed: the seed fixes the initial weights and the batch sequence."""
    arm = parse_arm(spec)
    train, val, vocab = corpus.train, corpus.val, corpus.vocab
    torch.manual_seed(seed)
    model = GPT(vocab, args.width, args.layers, args.heads, args.context).to(device)
    starts, _ = batch_plan(len(train), args.context, args.batch, args.steps, seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    opt = make_optimizer(arm, model, args.muon_lr, args.adamw_lr, args.weight_decay)
    # Same schedule for every arm: linear warm-up, cosine decay to 10 %.
    sched = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: min(1.0, (t + 1) / args.warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, t / args.steps))))) for o in (opt if isinstance(opt, list) else [opt])]
    res = ArmResult(arm=spec, label=arm.label, seed=seed,
                    init_digest=tensor_digest(model.state_dict().values()))
    muon_shapes = [p.shape for n, p in model.named_parameters()
                   if p.ndim >= 2 and not any(k in n for k in ("wte", "wpe", "lm_head"))]
    ns5_step = sum(ns5_flops(s[0], s[1]) for s in muon_shapes)
    batches = hashlib.sha256()
    t_start = time.time()
    prev_flops = 0.0
    for step in range(args.steps):
        model.train()
        s = starts[step].tolist()
        x = torch.stack([train[j:j + args.context] for j in s])
        y = torch.stack([train[j + 1:j + 1 + args.context] for j in s])
        batches.update(x.numpy().tobytes())
        batches.update(y.numpy().tobytes())
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
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
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            vl = evaluate(model, val, val_starts, args.context, vocab, autocast, device)
            res.steps.append(step + 1)
            res.val.append(vl)
            res.train_loss.append(loss.item())
            window = res.opt_ms[-args.eval_every:]
            print(f"[{arm.label} seed {seed}] step {step + 1:5d}  train {loss.item():.4f}  val {vl:.4f}  "
                  f"opt {sum(window) / len(window):.2f} ms", flush=True)
    res.final = res.val[-1]
    res.batch_digest = batches.hexdigest()[:16]
    res.wall_s = time.time() - t_start
    return res


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=SIZES, default="small",
                    help="model and training preset (the options below override its values)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--arms", help="comma-separated arms (common.py); default: the size's AdamW rates and MUON_ARMS")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds: every arm runs at each")
    for key in ("steps", "eval_every", "batch", "context", "layers", "width", "heads", "warmup"):
        ap.add_argument("--" + key.replace("_", "-"), type=int)
    ap.add_argument("--val-windows", type=int, default=0,
                    help="evaluate on this many evenly spaced validation windows (0: all of them)")
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adamw-lr", type=float, default=3e-3,
                    help="AdamW lr of the non-matrix parameters inside the Muon arms")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "quality-lm.json"))
    args = ap.parse_args(argv)
    for key, value in SIZES[args.size].items():
        if key != "adamw_lrs" and getattr(args, key) is None:
            setattr(args, key, value)
    args.arms = args.arms or default_arms(args.size)
    return args


def main(argv=None) -> list[ArmResult]:
    args = parse_args(argv)
    device = torch.device(args.device)
    corpus = CharData(Path(ROOT) / "data" / "tinyshakespeare.txt", torch.device("cpu"))  # the example's 90/10 split
    val_starts = torch.arange(0, len(corpus.val) - args.context, args.context)
    if args.val_windows:
        val_starts = val_starts[torch.linspace(0, len(val_starts) - 1, args.val_windows).long()]
    _, epochs = batch_plan(len(corpus.train), args.context, args.batch, args.steps, 0)
    shaped = GPT(corpus.vocab, args.width, args.layers, args.heads, args.context)
    params = sum(p.numel() for p in shaped.parameters())
    tokens = args.steps * args.batch * args.context
    command = None if argv is None else "python bench/quality/lm.py " + " ".join(argv)
    meta = dict(vars(args), kind="lm", command=command, epochs=epochs, train_tokens=tokens, train_chars=len(corpus.train),
                params=params, val_tokens=len(val_starts) * args.context)
    print(f"size {args.size}: {args.layers} x {args.width}, {params / 1e6:.2f} M parameters; {args.steps} steps of "
          f"{args.batch} x {args.context} = {tokens:,} tokens = {epochs:.2f} epochs of "
          f"{len(corpus.train) / 1e6:.2f} M; validation {meta['val_tokens']} tokens", flush=True)
    specs, seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    for spec in specs:
        parse_arm(spec)  # every arm's spelling checked before the first one trains
    results = []
    for seed in seeds:
        for spec in specs:
            results.append(train_arm(spec, seed, args, corpus, val_starts, device))
            save_results(args.out, meta, results)
    print(f"\n{'arm':44s} {'seed':>4s} {'final val':>10s} {'best val':>9s} {'opt ms':>8s} {'ortho GF/step':>14s}")
    for r in results:
        n = len(r.opt_ms)
        opt_ms = sorted(r.opt_ms[n // 10:])[len(r.opt_ms[n // 10:]) // 2] if n else math.nan
        print(f"{r.label:44s} {r.seed:4d} {r.final:10.4f} {min(r.val):9.4f} {opt_ms:8.2f} "
              f"{sum(r.ortho_flops) / max(1, n) / 1e9:14.2f}")
    return results


if __name__ == "__main__":
    main()

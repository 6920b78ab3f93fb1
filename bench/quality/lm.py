"""Language-model study: a GPT-2-style model, one run per optimizer arm and seed; every arm of a
seed has the same initial weights and the same batches (bench/quality/README.md: the sizes, why
they do not overfit, the arms). Two corpora: the shipped tinyshakespeare at character level
(sizes tiny, small, medium) and the English corpus of make_corpus.py in GPT-2 BPE tokens (sizes
gpt2, and gpt2-smoke for the CPU).

    python bench/quality/lm.py --size small --seeds 0,1 --out out/quality-lm-small.json
    python bench/quality/lm.py --size gpt2 --seeds 0,1,2 --time-budget 480 --out out/quality-lm-gpt2.json
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import lzma
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from train_gpt import CharData  # noqa: E402
from common import (ArmResult, Timer, batch_plan, cache_stats, record_cache, make_optimizer, ns5_flops,  # noqa: E402
                    parse_arm, save_results, step_all, tensor_digest, zero_all)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SHAKESPEARE = "shakespeare"  # --data: data/tinyshakespeare.txt at character level; else a make_corpus.py folder
CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "gpt2")

# Model sizes sized to the corpus (1.0 M training characters; README.md has the arithmetic): a
# batch of 8 x 256 characters makes 490 steps an epoch; 'small' trains 1.96 epochs, 'medium'
# (GPT-2 small's shape, the matrices of the old study) 0.98, so no character is a target twice.
# 'tiny' is the CPU test's.
# 'gpt2' (issue 43) trains on make_corpus.py's 31.5 M GPT-2 tokens: 400 steps of 64 x 1024 =
# 26.2 M tokens, 0.83 epochs, so no token is a target twice; 8 x 512 with GPT-2's vocabulary
# (padded to 50,304): 25.2 M parameters in the Muon matrices, 77 M in all. Estimated at 300
# TFLOP/s: about 335 MFLOP a token (6 N T with the head, plus attention), 22 TFLOP a step, 73 ms
# (about 100 ms with the fp32 cross-entropy's traffic); about 45 s a run with the evaluations
# (README.md). Its main arms run at seeds 0, 1, 2; the probe arms at seed 0, last (they run if
# the calls have time). 'gpt2-smoke' is its CPU check: the same corpus, arms and report, a tiny
# model, 8 k training tokens.
SIZES = {
    "tiny": dict(layers=2, width=64, heads=4, context=32, batch=4, steps=8, eval_every=4, warmup=2,
                 adamw_lrs=(1e-3,)),
    "small": dict(layers=6, width=384, heads=6, context=256, batch=8, steps=960, eval_every=80, warmup=50,
                  adamw_lrs=(1e-3, 2e-3, 4e-3), seeds="0,1"),
    "medium": dict(layers=12, width=768, heads=12, context=256, batch=8, steps=480, eval_every=40, warmup=30,
                   adamw_lrs=(3e-4, 6e-4, 1.2e-3), seeds="0,1"),
    "gpt2": dict(layers=8, width=512, heads=8, context=1024, batch=64, accum=2, steps=400, eval_every=40,
                 warmup=25, data=CORPUS, seeds="0,1,2", arms="issue43", extra_arms="issue43-probes", extra_seeds="0"),
    "gpt2-smoke": dict(layers=2, width=64, heads=4, context=64, batch=4, steps=6, eval_every=3, warmup=2,
                       data=CORPUS, corpus_tokens=8192, val_windows=8, seeds="0,1,2", arms="issue43",
                       extra_arms="issue43-probes", extra_seeds="0"),
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


# Issue 43's arms: AdamW, fresh Gram NS with Polar Express's coefficients (the seed's), and
# CacheMuon on it at gamma 2, 5 and 15 with the exact residual; ISSUE43_PROBES: the residual from
# 8 Gaussian probes at the same gammas (the gpt2 size's extra arms, at its first seed).
PE = "distmuon:algo=gram-ns:polar-express"
ISSUE43_ARMS = ("adamw:lr=1.5e-3", PE, f"{PE}:gamma=2", f"{PE}:gamma=5", f"{PE}:gamma=15")
ISSUE43_PROBES = (f"{PE}:gamma=2:probes=8", f"{PE}:gamma=5:probes=8", f"{PE}:gamma=15:probes=8")
ARM_SETS = {"issue43": ISSUE43_ARMS, "issue43-probes": ISSUE43_PROBES, "issue43+probes": ISSUE43_ARMS + ISSUE43_PROBES}


def default_arms(size: str) -> str:
    preset = SIZES[size]
    if "arms" in preset:
        return ",".join(ARM_SETS[preset["arms"]])
    return ",".join([f"adamw:lr={lr:g}" for lr in preset["adamw_lrs"]] + list(MUON_ARMS))


class TokenData:
    """make_corpus.py's token streams (uint16, xz-compressed or not): .train and .val as int64
    tensors; .vocab is GPT-2's, padded to a multiple of 64 for the products."""

    def __init__(self, folder: str, corpus_tokens: int = 0) -> None:
        self.meta = json.load(open(os.path.join(folder, "meta.json")))
        self.train = self._load(folder, "train", corpus_tokens)
        self.val = self._load(folder, "val", 0)
        self.vocab = (self.meta["vocab"] + 63) // 64 * 64

    def _load(self, folder: str, split: str, limit: int) -> torch.Tensor:
        raw = os.path.join(folder, f"{split}.bin")
        data = open(raw, "rb").read() if os.path.exists(raw) else lzma.open(raw + ".xz").read()
        if hashlib.sha256(data).hexdigest() != self.meta[f"{split}_sha256"]:
            raise SystemExit(f"lm.py: {raw}[.xz] does not match {folder}/meta.json: run make_corpus.py again")
        tokens = np.frombuffer(data, dtype="<u2")
        return torch.from_numpy(np.array(tokens[:limit] if limit else tokens)).long()


def load_corpus(data: str, corpus_tokens: int = 0):
    if data == SHAKESPEARE:
        corpus = CharData(Path(ROOT) / "data" / "tinyshakespeare.txt", torch.device("cpu"))  # the example's 90/10 split
        corpus.label = "tinyshakespeare, characters"
        if corpus_tokens:
            corpus.train = corpus.train[:corpus_tokens]
        return corpus
    if not os.path.exists(os.path.join(data, "meta.json")):
        raise SystemExit(f"lm.py: no corpus in {data}: run `python3 bench/quality/make_corpus.py` first")
    corpus = TokenData(data, corpus_tokens)
    corpus.label = "English corpus of make_corpus.py, GPT-2 BPE"
    return corpus


# What must agree between a record of an earlier call and this one for its runs to count here.
SAME_SETTING = ("size", "steps", "batch", "context", "layers", "width", "heads", "warmup", "corpus_tokens",
                "muon_lr", "adamw_lr", "weight_decay")


def done_runs(paths: list[str], meta: dict) -> set[tuple[str, int]]:
    """(arm, seed) of every run in these raw records (earlier device calls): not run again. A
    record of another setting or corpus is refused."""
    done = set()
    for path in paths:
        rec = json.load(open(path))
        differ = [k for k in SAME_SETTING if rec["meta"].get(k) != meta.get(k)]
        if rec["meta"].get("corpus", {}).get("train_sha256") != meta.get("corpus", {}).get("train_sha256"):
            differ.append("corpus")
        if differ:
            raise SystemExit(f"lm.py: {path} was run with another {', '.join(differ)}: not a part of this study")
        for a in rec["arms"]:
            done.add((a["arm"], a.get("seed", 0)))
    return done


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


def evaluate(model, val, starts, context, vocab, autocast, device) -> float:
    """Mean loss over fixed, non-overlapping validation windows (the same for every arm)."""
    chunk = min(64, max(1, 32768 // context))  # at most 32 k positions of logits at a time
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
    t_setup = time.time()
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
                    init_digest=tensor_digest(model.state_dict().values()),
                    device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    muon_shapes = [p.shape for n, p in model.named_parameters()
                   if p.ndim >= 2 and not any(k in n for k in ("wte", "wpe", "lm_head"))]
    ns5_step = sum(ns5_flops(s[0], s[1]) for s in muon_shapes)
    batches = hashlib.sha256()
    t_start = time.time()
    res.setup_s = t_start - t_setup
    prev_flops = 0.0
    for step in range(args.steps):
        model.train()
        s = starts[step].tolist()
        x = torch.stack([train[j:j + args.context] for j in s])
        y = torch.stack([train[j + 1:j + 1 + args.context] for j in s])
        batches.update(x.numpy().tobytes())
        batches.update(y.numpy().tobytes())
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        # args.accum micro-batches (the same batch, less memory for the logits): the mean loss.
        loss = 0.0
        for xm, ym in zip(x.chunk(args.accum), y.chunk(args.accum)):
            with autocast:
                part = F.cross_entropy(model(xm).float().view(-1, vocab), ym.reshape(-1)) / args.accum
            part.backward()
            loss = loss + part.detach()
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
    ap.add_argument("--arms", help="comma-separated arms (common.py), or a set: " + ", ".join(ARM_SETS)
                    + "; default: the size's (AdamW rates and MUON_ARMS, or its set)")
    ap.add_argument("--seeds", help="comma-separated seeds: every arm runs at each (default: the size's, else 0)")
    ap.add_argument("--extra-arms", help="arms (or a set) run after all the others, at --extra-seeds only "
                    "(default: the size's; '' for none)")
    ap.add_argument("--extra-seeds", help="seeds of the extra arms (default: the size's, else the first of --seeds)")
    ap.add_argument("--data", help=f"'{SHAKESPEARE}' or a make_corpus.py folder (default: the size's)")
    for key in ("steps", "eval_every", "batch", "context", "layers", "width", "heads", "warmup", "accum"):
        ap.add_argument("--" + key.replace("_", "-"), type=int)
    ap.add_argument("--corpus-tokens", type=int, help="use only the first N tokens of the training split (0: all)")
    ap.add_argument("--val-windows", type=int,
                    help="evaluate on this many evenly spaced validation windows (0: all of them)")
    ap.add_argument("--skip-done", nargs="*", default=[], metavar="RAW",
                    help="raw records of earlier calls: their (arm, seed) runs are not run again")
    ap.add_argument("--time-budget", type=float, default=0,
                    help="seconds: start a run only if it should end within this (the longest run so far "
                         "decides); the runs left are listed for the next call (0: no limit)")
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adamw-lr", type=float, default=3e-3,
                    help="AdamW lr of the non-matrix parameters inside the Muon arms")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "quality-lm.json"))
    args = ap.parse_args(argv)
    defaults = dict(accum=1, data=SHAKESPEARE, corpus_tokens=0, val_windows=0, seeds="0", extra_arms="")
    for key, value in {**defaults, **SIZES[args.size]}.items():
        if key not in ("adamw_lrs", "arms") and getattr(args, key) is None:
            setattr(args, key, value)
    args.arms = ",".join(ARM_SETS[args.arms]) if args.arms in ARM_SETS else args.arms or default_arms(args.size)
    args.extra_arms = ",".join(ARM_SETS[args.extra_arms]) if args.extra_arms in ARM_SETS else args.extra_arms
    args.extra_seeds = args.extra_seeds or args.seeds.split(",")[0]
    if args.batch % args.accum:
        ap.error(f"--accum {args.accum} must divide --batch {args.batch}")
    return args


def main(argv=None) -> list[ArmResult]:
    t_main = time.time()
    args = parse_args(argv)
    device = torch.device(args.device)
    corpus = load_corpus(args.data, args.corpus_tokens)
    val_starts = torch.arange(0, len(corpus.val) - args.context, args.context)
    if args.val_windows:
        val_starts = val_starts[torch.linspace(0, len(val_starts) - 1, args.val_windows).long()]
    _, epochs = batch_plan(len(corpus.train), args.context, args.batch, args.steps, 0)
    shaped = GPT(corpus.vocab, args.width, args.layers, args.heads, args.context)
    params = sum(p.numel() for p in shaped.parameters())
    tokens = args.steps * args.batch * args.context
    command = None if argv is None else "python bench/quality/lm.py " + " ".join(argv)
    muon_params = sum(p.numel() for n, p in shaped.named_parameters()
                      if p.ndim >= 2 and not any(k in n for k in ("wte", "wpe", "lm_head")))
    meta = dict(vars(args), kind="lm", command=command, epochs=epochs, train_tokens=tokens, train_chars=len(corpus.train),
                params=params, muon_params=muon_params, val_tokens=len(val_starts) * args.context,
                data_label=corpus.label, vocab=corpus.vocab)
    if isinstance(corpus, TokenData):
        meta["corpus"] = {k: corpus.meta[k] for k in ("tokenizer", "train_tokens", "val_tokens", "train_sha256")}
    print(f"size {args.size}: {args.layers} x {args.width}, {params / 1e6:.2f} M parameters ({muon_params / 1e6:.2f} M "
          f"in Muon matrices); {args.steps} steps of {args.batch} x {args.context} = {tokens:,} tokens = {epochs:.2f} "
          f"epochs of {len(corpus.train) / 1e6:.2f} M ({corpus.label}); validation {meta['val_tokens']} tokens", flush=True)
    specs, seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    extra = [s for s in args.extra_arms.split(",") if s]
    for spec in specs + extra:
        parse_arm(spec)  # every arm's spelling checked before the first one trains
    done = done_runs(args.skip_done, meta)
    # Seed by seed, so that a call cut short leaves whole seeds; the extra arms last.
    full = [(seed, spec) for seed in seeds for spec in specs] + \
           [(int(seed), spec) for seed in args.extra_seeds.split(",") for spec in extra]
    plan = [(seed, spec) for seed, spec in full if (spec, seed) not in done]
    if done:
        print(f"{len(full) - len(plan)} of {len(full)} runs are in earlier records "
              f"({', '.join(args.skip_done)}): {len(plan)} to run", flush=True)
    results, not_run = [], []
    for i, (seed, spec) in enumerate(plan):
        if args.time_budget and results:
            need = 1.05 * max(r.wall_s + r.setup_s for r in results)
            if time.time() - t_main + need > args.time_budget:
                not_run = [f"{sp}@{sd}" for sd, sp in plan[i:]]
                break
        r = train_arm(spec, seed, args, corpus, val_starts, device)
        results.append(r)
        gc.collect()  # the last arm's model, optimizer and graphs, before the next one's
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save_results(args.out, dict(meta, not_run=[f"{sp}@{sd}" for sd, sp in plan[i + 1:]]), results)
        print(f"run {i + 1}/{len(plan)}: {r.label} seed {seed}: final {r.final:.4f} in {r.wall_s:.1f} s "
              f"(+{r.setup_s:.1f} s set-up); {time.time() - t_main:.0f} s since start", flush=True)
    if not_run:
        save_results(args.out, dict(meta, not_run=not_run), results)
        print(f"\ntime budget ({args.time_budget:.0f} s): {len(not_run)} runs left for the next call "
              f"(give this record to --skip-done): {' '.join(not_run)}", flush=True)
    print(f"\n{'arm':44s} {'seed':>4s} {'final val':>10s} {'best val':>9s} {'opt ms':>8s} {'ortho GF/step':>14s}")
    for r in results:
        n = len(r.opt_ms)
        opt_ms = sorted(r.opt_ms[n // 10:])[len(r.opt_ms[n // 10:]) // 2] if n else math.nan
        print(f"{r.label:44s} {r.seed:4d} {r.final:10.4f} {min(r.val):9.4f} {opt_ms:8.2f} "
              f"{sum(r.ortho_flops) / max(1, n) / 1e9:14.2f}")
    return results


if __name__ == "__main__":
    main()

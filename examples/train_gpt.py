#!/usr/bin/env python3
"""Character-level GPT on tinyshakespeare with distmuon.torch.Muon, torch.optim.Muon and
torch.optim.AdamW, timing forward+backward and the optimizer step separately.

    python examples/train_gpt.py                              # distmuon, CPU preset
    python examples/train_gpt.py --optimizer distmuon,torch-muon,adamw   # all three (make demo)
    python examples/train_gpt.py --device cuda --optimizer distmuon,torch-muon,adamw   # GPU preset

Every optimizer starts from the same initial weights and sees the same batches. Muon (both
implementations) updates the hidden matrices; embeddings, the output head, norms and biases get
AdamW. The AdamW run's learning rate is tuned for each preset (PRESETS says how), so that the
baseline is not a strawman; the plot shows the loss against steps and against
training time, and each optimizer's share of the step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

# On the CPU, torch's operations and the engine's loops run on one OpenMP pool (torch's intra-op
# threads; the engine takes their count before each step) beside one OpenBLAS thread. Passive
# waiting lets the pool's threads sleep between parallel loops instead of spinning, which takes
# cores from other processes on a shared machine; on an idle one it costs each of torch's many
# small loops a wake-up (thread_settings() prints what a run used). (Read by libgomp when torch
# loads, so it must come first.)
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OPTIMIZERS = ("distmuon", "adamw", "torch-muon")


# ---- model ------------------------------------------------------------------------------------


@dataclass
class GPTConfig:
    vocab: int
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.attn_out = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp_in = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.mlp_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("attn_out.weight", "mlp_out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


# ---- data -------------------------------------------------------------------------------------


class CharData:
    """tinyshakespeare as character ids, 90 % train / 10 % validation."""

    def __init__(self, path: Path, device: torch.device) -> None:
        text = path.read_text(encoding="utf-8")
        chars = sorted(set(text))
        self.vocab = len(chars)
        lut = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([lut[c] for c in text], dtype=torch.long)
        n = int(0.9 * len(ids))
        self.train, self.val = ids[:n], ids[n:]
        self.device = device

    def batch(self, split: str, batch_size: int, block: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.train if split == "train" else self.val
        starts = torch.randint(0, len(data) - block - 1, (batch_size,), generator=gen)
        x = torch.stack([data[s : s + block] for s in starts.tolist()])
        y = torch.stack([data[s + 1 : s + 1 + block] for s in starts.tolist()])
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


# ---- optimizers -------------------------------------------------------------------------------


@dataclass
class HParams:
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    # The AdamW part of the Muon runs (embeddings, head, norms, biases).
    muon_adamw_lr: float = 3e-3
    # The AdamW run (every parameter): tuned per preset.
    adamw_lr: float = 3e-3
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_weight_decay: float = 0.0


def build_optimizers(kind: str, model: nn.Module, hp: HParams, cache_gamma: float | None) -> list[torch.optim.Optimizer]:
    from distmuon.torch import Muon, default_muon_filter

    fused = next(model.parameters()).is_cuda
    if kind == "distmuon":
        return [
            Muon(
                model,
                lr=hp.muon_lr,
                momentum=hp.muon_momentum,
                weight_decay=hp.muon_weight_decay,
                cache_gamma=cache_gamma,
                adamw_lr=hp.muon_adamw_lr,
                adamw_betas=hp.adamw_betas,
                adamw_weight_decay=hp.adamw_weight_decay,
            )
        ]
    if kind == "adamw":
        return [
            torch.optim.AdamW(
                model.parameters(), lr=hp.adamw_lr, betas=hp.adamw_betas, weight_decay=hp.adamw_weight_decay, fused=fused
            )
        ]
    # torch.optim.Muon on the same matrices distmuon picks, AdamW on the rest
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden = [p for n, p in model.named_parameters() if id(p) not in embeddings and default_muon_filter(n, p)]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return [
        torch.optim.Muon(hidden, lr=hp.muon_lr, momentum=hp.muon_momentum, weight_decay=hp.muon_weight_decay),
        torch.optim.AdamW(rest, lr=hp.muon_adamw_lr, betas=hp.adamw_betas, weight_decay=hp.adamw_weight_decay, fused=fused),
    ]


def warmup_cosine(steps: int, warmup: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    return factor


# ---- progress ---------------------------------------------------------------------------------


def progress(total: int, desc: str) -> tuple[Iterator[int], Callable[[str], None]]:
    """tqdm when installed, else a one-line counter; returns (iterator, set_postfix)."""
    try:
        from tqdm import tqdm

        bar = tqdm(range(total), desc=desc, dynamic_ncols=True, file=sys.stdout)
        return iter(bar), lambda s: bar.set_postfix_str(s, refresh=False)
    except ImportError:
        state = {"postfix": ""}

        def gen() -> Iterator[int]:
            width = 30
            for i in range(total):
                yield i
                done = int(width * (i + 1) / total)
                print(f"\r{desc} [{'#' * done}{'.' * (width - done)}] {i + 1}/{total} {state['postfix']}", end="", flush=True)
            print()

        return gen(), lambda s: state.__setitem__("postfix", s)


# ---- training ---------------------------------------------------------------------------------


@dataclass
class RunResult:
    optimizer: str
    steps: int
    final_val_loss: float = float("nan")
    train_losses: list[float] = field(default_factory=list)
    val_points: list[tuple[int, float]] = field(default_factory=list)
    fwd_bwd_ms: list[float] = field(default_factory=list)
    opt_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)  # distmuon: Muon.stats() at the end
    stopped_at: int | None = None  # a baseline stopped by --baseline-budget-s: its last step


@torch.no_grad()
def evaluate(model: nn.Module, data: CharData, args: argparse.Namespace) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)  # the same validation batches every time
    losses = []
    for _ in range(args.eval_iters):
        with torch.autocast(data.device.type, dtype=torch.bfloat16, enabled=args.amp):
            losses.append(model(*data.batch("val", args.batch_size, args.block_size, gen)).item())
    model.train()
    return sum(losses) / len(losses)


class Trainer:
    """One optimizer's model, optimizers, schedules and batch stream, stepped one step at a time."""

    def __init__(self, kind: str, init: dict[str, torch.Tensor], cfg: GPTConfig, data: CharData, args: argparse.Namespace) -> None:
        self.device = torch.device(args.device)
        self.model = GPT(cfg).to(self.device)
        self.model.load_state_dict(init)
        self.opts = build_optimizers(kind, self.model, HParams(adamw_lr=args.adamw_lr), args.cache_gamma)
        self.scheds = [torch.optim.lr_scheduler.LambdaLR(o, warmup_cosine(args.steps, args.warmup)) for o in self.opts]
        self.gen = torch.Generator().manual_seed(0)  # the same training batches for every optimizer
        self.res = RunResult(kind, args.steps)
        self.data, self.args = data, args

    @property
    def last(self) -> int:
        """The last step this trainer runs: where --baseline-budget-s stopped it, else the end."""
        return self.res.stopped_at or self.args.steps

    def step(self, step: int) -> None:
        args, res = self.args, self.res
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        x, y = self.data.batch("train", args.batch_size, args.block_size, self.gen)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = self.model(x, y)
        loss.backward()
        sync()
        t1 = time.perf_counter()
        for o in self.opts:
            o.step()
        sync()
        t2 = time.perf_counter()
        for o in self.opts:
            o.zero_grad(set_to_none=True)
        for s in self.scheds:
            s.step()
        res.train_losses.append(loss.item())
        res.fwd_bwd_ms.append((t1 - t0) * 1e3)
        res.opt_ms.append((t2 - t1) * 1e3)
        res.wall_s += time.perf_counter() - t0
        if (step + 1) % args.eval_every == 0 or step + 1 == self.last:
            res.val_points.append((step + 1, evaluate(self.model, self.data, args)))

    def finish(self) -> RunResult:
        self.res.final_val_loss = self.res.val_points[-1][1]
        if self.res.optimizer == "distmuon":
            self.res.stats = self.opts[0].stats()  # type: ignore[attr-defined]
        return self.res


# Steps timed before a baseline's whole run is projected against --baseline-budget-s.
BUDGET_PROBE_STEPS = 5


def budget_stop(res: RunResult, args: argparse.Namespace) -> int | None:
    """The step at which a baseline stops so that its training stays within the budget (a
    multiple of --eval-every, so that distmuon has a validation loss at the same step), or None
    when its whole run fits. Its steps so far (warm-up included) give the projection."""
    per_step = res.wall_s / len(res.train_losses)
    if per_step * args.steps <= args.baseline_budget_s:
        return None
    fits = int(args.baseline_budget_s / per_step) // args.eval_every * args.eval_every
    return min(args.steps, max(args.eval_every, fits))


def train(kinds: list[str], init: dict[str, torch.Tensor], cfg: GPTConfig, data: CharData, args: argparse.Namespace) -> list[RunResult]:
    """Trains every optimizer in lockstep (step i of each, in turn), so that the load of a shared
    machine falls on them alike and their step times compare. With --baseline-budget-s, a
    baseline (not distmuon) whose run would take longer stops early, at an evaluation step."""
    trainers = [Trainer(kind, init, cfg, data, args) for kind in kinds]
    it, postfix = progress(args.steps, "train")
    for step in it:
        for t in trainers:
            if step < t.last:
                t.step(step)
        if args.baseline_budget_s and step + 1 == min(BUDGET_PROBE_STEPS, args.steps):
            for t in trainers:
                stop = budget_stop(t.res, args) if t.res.optimizer != "distmuon" else None
                if stop is not None and stop > step:
                    t.res.stopped_at = stop
                    print(f"\n{t.res.optimizer}: {t.res.wall_s / (step + 1) * 1e3:.0f} ms a step here, so it stops at "
                          f"step {stop} of {args.steps} (--baseline-budget-s {args.baseline_budget_s:g})", flush=True)
        if step % 10 == 0 or step + 1 == args.steps:
            postfix(" ".join(f"{t.res.optimizer} {t.res.train_losses[-1]:.3f} ({t.res.opt_ms[-1]:.0f} ms)" for t in trainers))
    return [t.finish() for t in trainers]


def thread_settings(device: torch.device, kinds: list[str]) -> dict[str, object]:
    """The CPU threads a run used: torch's intra-op threads and OpenMP's wait policy, and with
    distmuon the threads of the engine's loops (what the front last set: torch's count) and its
    BLAS (library, kernels and thread count, as the engine names its backend)."""
    if device.type != "cpu":
        return {}
    out: dict[str, object] = {
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
    }
    if "distmuon" in kinds:
        from distmuon import _C

        out["distmuon_threads"] = _C.cpu_threads()
        out["distmuon_backend"] = _C.Engine("cpu").backend_name
    return out


def median_after_warmup(xs: list[float]) -> float:
    tail = xs[min(len(xs) // 5, 10) :] or xs
    return statistics.median(tail)


def plot(results: list[RunResult], path: Path, title: str) -> None:
    """Loss against steps, loss against training time (forward, backward and optimizer; batches
    and evaluations not counted), and the split of a step into forward+backward and optimizer."""
    try:
        import matplotlib
    except ImportError:  # e.g. the GPU machine: the JSON summary still has every number
        print(f"(matplotlib is not installed: no {path.name})")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time, split) = plt.subplots(1, 3, figsize=(16, 5), gridspec_kw={"width_ratios": [1, 1, 0.8]})
    styles = [("-", "o"), ("--", "s"), (":", "^")]  # distinguishable where curves coincide
    for i, r in enumerate(results):
        ls, marker = styles[i % len(styles)]
        k = max(1, len(r.train_losses) // 50)
        window = [r.train_losses[max(0, j - k) : j + 1] for j in range(len(r.train_losses))]
        smooth = [sum(w) / len(w) for w in window]
        clock, t = [], 0.0
        for fb, op in zip(r.fwd_bwd_ms, r.opt_ms):
            t += (fb + op) / 1e3
            clock.append(t)
        steps, vals = zip(*r.val_points)
        line = by_step.plot(range(1, len(smooth) + 1), smooth, ls, alpha=0.4, label=f"{r.optimizer} train")[0]
        color = line.get_color()
        by_step.plot(steps, vals, ls, marker=marker, color=color, label=f"{r.optimizer} val ({r.final_val_loss:.3f})")
        by_time.plot(clock, smooth, ls, alpha=0.4, color=color)
        by_time.plot([clock[s - 1] for s in steps], vals, ls, marker=marker, color=color, label=f"{r.optimizer} val")
        fb, op = median_after_warmup(r.fwd_bwd_ms), median_after_warmup(r.opt_ms)
        split.barh(i, fb, color=color, alpha=0.35)
        split.barh(i, op, left=fb, color=color)
        split.text(fb + op, i, f" {op:.1f} ms ({op / (fb + op):.0%})", va="center", fontsize=9)
    by_step.set_xlabel("step")
    by_time.set_xlabel("training time (s): forward, backward and optimizer")
    for ax in (by_step, by_time):
        ax.set_ylabel("cross-entropy (nats/char)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    split.set_yticks(range(len(results)), [r.optimizer for r in results])
    split.invert_yaxis()
    split.set_xlabel("ms per step: forward+backward, optimizer (its share)")
    split.set_xlim(0, 1.35 * max(median_after_warmup(r.fwd_bwd_ms) + median_after_warmup(r.opt_ms) for r in results))
    split.grid(alpha=0.3, axis="x")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


PRESETS = {
    # 4 x 128, 300 steps: about two minutes for the three optimizers on 2 unloaded CPU cores.
    # adamw_lr: the best validation loss of AdamW alone at 1e-3, 2e-3, 3e-3, 5e-3 and 1e-2
    # (bench/results/2026-12-01-cpu-demo/adamw_sweep.md).
    "cpu": {
        "n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch_size": 16,
        "steps": 300, "eval_iters": 10, "adamw_lr": 3e-3,
    },
    # GPT-2-small-sized blocks (12 x 768, 85 M parameters): a few minutes per optimizer on one H200.
    # adamw_lr: the best of 6e-4 and 1.5e-3 (bench/results/quality: this model, 600 steps, best
    # validation loss 1.67 and 2.11) and 3e-3 (2.48 after 400 steps, bench/results/2026-11-29-h200-front).
    "gpu": {
        "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 256, "batch_size": 32,
        "steps": 1000, "eval_iters": 20, "adamw_lr": 6e-4,
    },
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--optimizer", default="distmuon", help=f"one or a comma list of {', '.join(OPTIMIZERS)}")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="model/batch/steps preset (default: by device)")
    ap.add_argument("--steps", type=int, help="training steps")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-head", type=int)
    ap.add_argument("--n-embd", type=int)
    ap.add_argument("--warmup", type=int, help="LR warm-up steps (default: 5%% of the steps)")
    ap.add_argument("--eval-every", type=int, help="steps between validation evaluations")
    ap.add_argument("--eval-iters", type=int, help="validation batches per evaluation")
    ap.add_argument("--adamw-lr", type=float, help="learning rate of the AdamW run (default: the preset's, tuned)")
    ap.add_argument("--cache-gamma", type=float, help="CacheMuon residual threshold (distmuon only)")
    ap.add_argument("--amp", action=argparse.BooleanOptionalAction, help="bf16 autocast in forward (default: on CUDA)")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--baseline-budget-s", type=float, default=0,
                    help="seconds of training a baseline (torch-muon, adamw) may take: one that would take "
                         "longer stops at the last evaluation step that fits (0: no limit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", type=Path, default=REPO / "data" / "tinyshakespeare.txt")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "train_gpt.png", help="loss-curve PNG (a .json summary is written beside it)")
    args = ap.parse_args()
    preset = PRESETS[args.preset or ("gpu" if args.device.startswith("cuda") else "cpu")]
    # The AdamW learning rate was tuned for the preset's model: only its default is "tuned".
    model_keys = ("n_layer", "n_head", "n_embd", "block_size", "batch_size")
    overridden = [k for k in model_keys if getattr(args, k) is not None]
    args.adamw_lr_tuned = args.adamw_lr is None and not overridden
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k in ("steps", "batch_size", "block_size", "n_layer", "n_head", "n_embd", "eval_iters"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be at least 1 (got {getattr(args, k)})")
    if args.n_embd % args.n_head:
        ap.error(f"--n-embd ({args.n_embd}) must be a multiple of --n-head ({args.n_head})")
    for k in ("warmup", "eval_every", "threads", "baseline_budget_s"):  # optional; 0: the default (no limit)
        if getattr(args, k) is not None and getattr(args, k) < 0:
            ap.error(f"--{k.replace('_', '-')} must be >= 0 (got {getattr(args, k)})")
    if not math.isfinite(args.baseline_budget_s):
        ap.error(f"--baseline-budget-s must be a finite number of seconds (got {args.baseline_budget_s})")
    for k in ("adamw_lr", "cache_gamma"):
        v = getattr(args, k)
        if v is not None and not (math.isfinite(v) and v > 0):
            ap.error(f"--{k.replace('_', '-')} must be a finite number > 0 (got {v})")
    if not args.data.is_file():
        ap.error(f"--data {args.data}: no such file")
    try:
        torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device}: {e}")
    args.warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    if args.amp is None:
        args.amp = args.device.startswith("cuda")
    args.eval_every = args.eval_every or max(1, args.steps // 10)
    kinds = [k.strip() for k in args.optimizer.split(",") if k.strip()]
    bad = [k for k in kinds if k not in OPTIMIZERS]
    if bad or not kinds:
        ap.error(f"unknown optimizer(s) {bad}; choose from {', '.join(OPTIMIZERS)}")
    args.optimizers = kinds
    if args.cache_gamma is not None and "distmuon" not in kinds:
        ap.error("--cache-gamma applies to --optimizer distmuon")
    return args


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    data = CharData(args.data, device)
    cfg = GPTConfig(data.vocab, args.block_size, args.n_layer, args.n_head, args.n_embd)
    torch.manual_seed(args.seed)
    init = {k: v.clone() for k, v in GPT(cfg).state_dict().items()}
    n_params = sum(v.numel() for v in init.values())
    print(
        f"GPT {cfg.n_layer} layers x {cfg.n_embd} dims, {n_params / 1e6:.2f} M parameters; batch {args.batch_size} x "
        f"{cfg.block_size} chars; {args.steps} steps on {device} ({torch.get_num_threads()} CPU threads"
        f"{', bf16 autocast' if args.amp else ''})"
    )
    results = train(args.optimizers, init, cfg, data, args)
    threads = thread_settings(device, args.optimizers)
    print(f"\n{'optimizer':>10} | {'val loss':>8} | {'fwd+bwd ms':>10} | {'optimizer ms':>12} | {'opt share':>9} | {'train s':>7}")
    print("-" * 72)
    for r in results:
        fb, op = median_after_warmup(r.fwd_bwd_ms), median_after_warmup(r.opt_ms)
        print(f"{r.optimizer:>10} | {r.final_val_loss:8.4f} | {fb:10.2f} | {op:12.2f} | {op / (fb + op):8.1%} | {r.wall_s:7.1f}"
              + (f"  (stopped at step {r.stopped_at})" if r.stopped_at else ""))
    ours = next((r for r in results if r.optimizer == "distmuon"), None)
    for r in results:
        if r.stopped_at and ours:
            at = dict(ours.val_points).get(r.stopped_at)
            print(f"{r.optimizer} stopped at step {r.stopped_at} (--baseline-budget-s): its validation loss there "
                  f"{r.final_val_loss:.4f}, distmuon's " + (f"{at:.4f}" if at is not None else "not evaluated there"))
    print(
        "(step times: medians after warm-up, the device synchronised around each part; train s: the\n"
        " steps without evaluations)"
    )
    if threads:
        line = f"CPU threads: torch {threads['torch_threads']} (OMP_WAIT_POLICY={threads['omp_wait_policy']})"
        if "distmuon_threads" in threads:
            line += f"; distmuon's loops {threads['distmuon_threads']}, products on {threads['distmuon_backend']}"
        print(line)
    if "adamw" in args.optimizers:
        print(f"The AdamW run's learning rate: {args.adamw_lr:g}{' (tuned for this preset: PRESETS)' if args.adamw_lr_tuned else ''}")
    by_kind = {r.optimizer: median_after_warmup(r.opt_ms) for r in results}
    if "distmuon" in by_kind and "torch-muon" in by_kind:
        print(
            f"distmuon's optimizer step: {by_kind['distmuon']:.2f} ms, {by_kind['distmuon'] / by_kind['torch-muon']:.2f}x "
            f"torch.optim.Muon's ({by_kind['torch-muon']:.2f} ms)"
        )
    for r in results:
        if args.cache_gamma is not None and r.stats:
            st = r.stats
            print(
                f"CacheMuon gamma {args.cache_gamma}: {st['cache_hits']} hits / {st['cache_refreshes']} refreshes "
                f"(hit rate {st['cache_hit_rate']:.1%}, last step {st['last_hit_rate']:.1%}), "
                f"{st['cache_flops_saved']:.1%} of the orthogonalization FLOPs saved"
            )
    title = f"char GPT {cfg.n_layer}x{cfg.n_embd} on tinyshakespeare, {args.steps} steps, {device}"
    plot(results, args.out, title)
    summary = {
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "config": asdict(cfg),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "device": str(device),
        "torch": torch.__version__,
        "threads": threads,
        "results": [
            {
                "optimizer": r.optimizer,
                "final_val_loss": r.final_val_loss,
                "val_points": r.val_points,
                "fwd_bwd_ms_median": median_after_warmup(r.fwd_bwd_ms),
                "optimizer_ms_median": median_after_warmup(r.opt_ms),
                "wall_s": r.wall_s,
                "stopped_at": r.stopped_at,
                "stats": r.stats,
            }
            for r in results
        ],
    }
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    print(f"loss curves: {args.out}\nsummary: {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

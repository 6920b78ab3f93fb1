"""Vision study: a small ResNet on scikit-learn's bundled digits set (8x8 images, offline), one run
per optimizer arm, identical init and batch order. Conv kernels (4D) go to Muon flattened to
(out, in*kh*kw); torch.optim.Muon only takes 2D parameters, so it has no arm here.

    python bench/quality/vision.py --device cuda --epochs 40 --out out/quality-vision.json
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import ArmResult, Timer, cache_stats, record_cache, make_optimizer, parse_arm, save_results, step_all, zero_all  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNet(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(ResBlock(width, width, 1), ResBlock(width, 2 * width, 2),
                                    ResBlock(2 * width, 2 * width, 1), ResBlock(2 * width, 4 * width, 2))
        self.fc_out = nn.Linear(4 * width, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc_out(x.mean(dim=(2, 3)))


def load_digits_offline(path: str | None) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (1797 images): from the package when it is installed,
    else from an .npz copy of it."""
    if path:
        with np.load(path) as f:
            return f["images"], f["target"]
    try:
        from sklearn.datasets import load_digits  # bundled with scikit-learn: no download
    except ImportError as e:
        raise SystemExit("the digits set needs scikit-learn here, or --digits FILE.npz (written by --save-digits "
                         "on a machine that has it)") from e
    d = load_digits()
    return d.images, d.target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--arms", default="adamw:lr=3e-3,distmuon:algo=ns5,distmuon:algo=auto,distmuon:algo=gram-ns,"
                    "distmuon:algo=gram-ns:gamma=2,distmuon:algo=gram-ns:gamma=15,distmuon:algo=gram-ns:gamma=15:shadow=1")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--muon-lr", type=float, default=0.02)
    ap.add_argument("--adamw-lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "out", "quality-vision.json"))
    ap.add_argument("--digits", help="an .npz with 'images' (N x 8 x 8) and 'target' (N) where scikit-learn "
                    "is not installed (the GPU machine): write it with --save-digits on a machine that has it")
    ap.add_argument("--save-digits", help="write scikit-learn's digits set to this .npz and exit")
    args = ap.parse_args()
    if args.save_digits:
        images, target = load_digits_offline(None)
        np.savez_compressed(args.save_digits, images=images.astype(np.uint8), target=target.astype(np.uint8))
        print(f"wrote {args.save_digits} ({len(target)} images)")
        return

    images, target = load_digits_offline(args.digits)
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(target, dtype=torch.long)
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(x), generator=g)
    n_test = len(x) // 5
    device = torch.device(args.device)
    xte, yte = x[perm[:n_test]].to(device), y[perm[:n_test]].to(device)
    xtr, ytr = x[perm[n_test:]].to(device), y[perm[n_test:]].to(device)
    orders = [torch.randperm(len(xtr), generator=g) for _ in range(args.epochs)]
    torch.manual_seed(args.seed)
    init = ResNet().state_dict()

    results = []
    for spec in args.arms.split(","):
        arm = parse_arm(spec)
        model = ResNet().to(device)
        model.load_state_dict(init)
        opt = make_optimizer(arm, model, args.muon_lr, args.adamw_lr, args.weight_decay)
        res = ArmResult(arm=spec, label=arm.label)
        t0, step, prev = time.time(), 0, 0.0
        for epoch in range(args.epochs):
            model.train()
            for i in range(0, len(xtr), args.batch):
                idx = orders[epoch][i:i + args.batch].to(device)
                loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
                loss.backward()
                with Timer(device) as t:
                    step_all(opt)
                zero_all(opt)
                res.opt_ms.append(t.ms)
                st = cache_stats(opt)
                if st is not None:
                    res.ortho_flops.append(float(st["ortho_flops"]) - prev)
                    prev = float(st["ortho_flops"])
                    record_cache(res, st)
                else:
                    res.ortho_flops.append(0.0)
                step += 1
            model.eval()
            with torch.no_grad():
                acc = (model(xte).argmax(1) == yte).float().mean().item()
            res.steps.append(step)
            res.val.append(acc)
            res.train_loss.append(loss.item())
            print(f"[{arm.label}] epoch {epoch:3d}  loss {loss.item():.4f}  test acc {acc:.4f}", flush=True)
        res.final = res.val[-1]
        res.wall_s = time.time() - t0
        results.append(res)
        save_results(args.out, vars(args), results)
    print(f"\n{'arm':36s} {'final acc':>10s} {'best acc':>9s}")
    for r in results:
        print(f"{r.label:36s} {r.final:10.4f} {max(r.val):9.4f}")


if __name__ == "__main__":
    main()

"""Collects demo-ab.sh's runs into summary.json: python3 collect.py OUT.json DIR:TAG:COMMIT ...

Each run: build (base = 1757f9d, new = COMMIT of that directory's runs), condition (idle/busy:
busy = the one-core spinner beside it; the machine was shared, so forward+backward tells what
the run really had: about 45 ms both cores, 70 one, 120 less), each optimizer's step and
forward+backward medians, final validation losses, the thread line."""
import glob
import json
import os
import re
import sys

runs = []
for arg in sys.argv[2:]:
    d, tag, commit = arg.split(":")
    for path in sorted(glob.glob(os.path.join(d, "*.json"))):
        m = re.match(r"(\w+)-(idle|busy)-(\d+)\.json", os.path.basename(path))
        if not m:
            continue
        s = json.load(open(path))
        res = {r["optimizer"]: r for r in s["results"]}
        opt = {k: round(v["optimizer_ms_median"], 2) for k, v in res.items()}
        runs.append({
            "run": f"{tag}{m.group(1)}-{m.group(2)}-{m.group(3)}",
            "build": m.group(1),
            "commit": "1757f9d" if m.group(1) == "base" else commit,
            "condition": m.group(2),
            "optimizer_ms": opt,
            "fwd_bwd_ms": {k: round(v["fwd_bwd_ms_median"], 1) for k, v in res.items()},
            "distmuon_over_torch_muon": round(opt["distmuon"] / opt["torch-muon"], 3),
            "final_val_loss": {k: round(v["final_val_loss"], 4) for k, v in res.items()},
            "threads": s.get("threads", {}),
        })
json.dump({"command": "python3 examples/train_gpt.py --optimizer distmuon,torch-muon,adamw",
           "builds": {"base": "1757f9d (main)", "new": "this branch, commit per run"},
           "runs": runs}, open(sys.argv[1], "w"), indent=1)
for r in runs:
    print(f"{r['run']:22s} {r['commit']} distmuon {r['optimizer_ms']['distmuon']:6.2f}  torch-muon "
          f"{r['optimizer_ms']['torch-muon']:6.2f}  ratio {r['distmuon_over_torch_muon']:.2f}  "
          f"fwd+bwd {r['fwd_bwd_ms']['distmuon']:5.1f}  val {r['final_val_loss']['distmuon']}"
          f"/{r['final_val_loss']['torch-muon']}")

#!/usr/bin/env bash
# The demo (examples/train_gpt.py, distmuon, torch.optim.Muon and AdamW in lockstep) with two
# builds of the Python package side by side, idle and beside a one-core spinner, interleaved:
# demo-ab.sh ROUNDS OUTDIR LABEL=PYTHONPATH_DIR ... Each run's summary JSON lands in OUTDIR.
set -u
rounds=$1; out=$2; shift 2
mkdir -p "$out"
repo=$(cd "$(dirname "$0")/../.." && pwd)
for ((i = 1; i <= rounds; i++)); do
  for mode in idle busy; do
    for spec in "$@"; do
      label=${spec%%=*}; dir=${spec#*=}
      spin=
      if [ "$mode" = busy ]; then
        python3 -c "import time; t = time.time() + 400
while time.time() < t: pass" & spin=$!
      fi
      PYTHONPATH=$dir python3 "$repo/examples/train_gpt.py" --optimizer distmuon,torch-muon,adamw \
        --out "$out/$label-$mode-$i.png" > "$out/$label-$mode-$i.log" 2>&1
      [ -n "$spin" ] && { kill "$spin"; wait "$spin" 2>/dev/null; }
      echo "$label $mode $i: $(grep "optimizer step" "$out/$label-$mode-$i.log")"
    done
  done
done

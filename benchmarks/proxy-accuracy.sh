#!/usr/bin/env bash
# Test accuracy of the benchmarked configurations on the accuracy proxy at equal epochs, over seeds
# (docs/benchmarks.md, "Which codec learns"): WRN-10-1, 2 workers x batch 32, cosine schedule from
# lr 0.1, the final evaluation of each run.
# Usage: bash benchmarks/proxy-accuracy.sh [OUT_DIR] [EPOCHS] [SEEDS]   (defaults: proxy-accuracy 15 "0 1 2")
# DATASET=digits runs the same on the second dataset (real handwritten digits: pip install
# 'psgrad[digits]'). TOPOLOGY=colocated trains the same models on 2 ranks instead of 1 server + 2
# workers (every topology with servers trains them step for step alike), in less time.
# CONFIGS="A;B" measures those configurations instead (each a --codec value and more options), dense
# always first: e.g. the local-step rows of "Slow links" with TOPOLOGY=colocated.
# Prints one line per configuration: the accuracies by seed, their median and spread (max - min),
# and its median ratio to dense of the same seed.
set -euo pipefail
out=${1:-proxy-accuracy}
epochs=${2:-15}
seeds=${3:-0 1 2}
here=$(cd "$(dirname "$0")/.." && pwd)
psgrad=${PSGRAD:-$here/.venv/bin/psgrad}
mpiexec=${MPIEXEC:-$here/.venv/bin/mpiexec}
python=${PSGRAD_PYTHON:-$here/.venv/bin/python}
dataset=${DATASET:-proxy}
topology=${TOPOLOGY:-ps}
ranks=3; [ "$topology" = ps ] || ranks=2
configs=(
  "none"
  "qsgd:levels=16 --down-codec qsgd:levels=16"
  "sign --feedback ef --down-codec sign"
  "sign --feedback ef --down-codec qsgd:levels=16"
  "topk:ratio=0.01,approx=1 --feedback ef --down-codec topk:ratio=0.01,approx=1"
  "powersgd:rank=8"
  "powersgd:rank=2"
  "sign:bucket=32 --feedback ef --down-codec qsgd:levels=16"
  "topk:ratio=0.01 --feedback ef"
)
if [ -n "${CONFIGS:-}" ]; then
  IFS=';' read -r -a configs <<<"none;$CONFIGS"
fi
mkdir -p "$out"
for i in "${!configs[@]}"; do
  for seed in $seeds; do
    log="$out/config$i-seed$seed"
    [ -e "$log/eval.csv" ] && continue  # rerunning the script finishes what an earlier run left
    # shellcheck disable=SC2086  # a configuration is several options
    "$mpiexec" -n "$ranks" "$psgrad" train --model wrn --depth 10 --widen-factor 1 --dataset "$dataset" \
      --topology "$topology" --epochs "$epochs" --batch-size 32 --schedule cosine --eval-every-epochs "$epochs" --seed "$seed" \
      --no-progress --log-dir "$log" --codec ${configs[$i]} >/dev/null
  done
done
"$python" - "$out" "$seeds" "${configs[@]}" <<'PY'
import csv, statistics, sys
from pathlib import Path

out, seeds, configs = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3:]
def final(i, seed):
    with open(out / f"config{i}-seed{seed}" / "eval.csv") as f:
        return float(list(csv.DictReader(f))[-1]["test_acc"])

dense = [final(0, seed) for seed in seeds]  # configs[0] is dense
for i, config in enumerate(configs):
    accs = [final(i, seed) for seed in seeds]
    ratio = statistics.median(a / d for a, d in zip(accs, dense))
    print(f"{config:80s} {' '.join(f'{a:.3f}' for a in accs)}  median {statistics.median(accs):.3f}  "
          f"spread {max(accs) - min(accs):.3f}  x dense {ratio:.3f}")
PY

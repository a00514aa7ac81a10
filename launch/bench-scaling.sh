#!/usr/bin/env bash
# When to leave the single server: step time against the number of workers on slow links, one
# server rank against colocated servers, dense and compressed (docs/benchmarks.md, "Scaling").
# Usage: sudo bash launch/bench-scaling.sh [OUT_DIR] [BANDWIDTH] [WORKERS] [STEPS]
#   defaults: bench-scaling 10mbit "2 4 8" 8 — shaped links need root; a small model (mlp) keeps
#   the run link-bound, since N ranks share this machine's cores.
set -euo pipefail
out=${1:-bench-scaling}
bandwidth=${2:-10mbit}
workers=${3:-2 4 8}
steps=${4:-8}
here=$(cd "$(dirname "$0")/.." && pwd)
psgrad=${PSGRAD:-$here/.venv/bin/psgrad}
python=${PSGRAD_PYTHON:-$here/.venv/bin/python}
mkdir -p "$out"
codecs="none;none --topology colocated"
codecs+=";sign --feedback ef --down-codec sign;sign --feedback ef --down-codec sign --topology colocated"
for n in $workers; do
  "$psgrad" bench --model mlp --batch-size 32 --steps "$steps" --warmup 2 --workers "$n" \
    --bandwidth "$bandwidth" --codecs "$codecs" --json "$out/workers-$n.json" | tee "$out/workers-$n.txt"
done
"$python" - "$out" $workers <<'PY'
import json, sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

out, counts = Path(sys.argv[1]), [int(n) for n in sys.argv[2:]]
series: dict[str, list[float]] = {}
for n in counts:
    for row in json.loads((out / f"workers-{n}.json").read_text()):
        series.setdefault(row["codec"], []).append(1000 / row["it_per_s"])
fig, ax = plt.subplots(figsize=(7, 4))
for name, ms in series.items():
    ax.plot(counts, ms, marker="o", label=name)
ax.set_xlabel("workers")
ax.set_ylabel("ms per step")
ax.set_xticks(counts)
ax.set_yscale("log")
ax.legend(fontsize=7)
ax.set_title("step time vs workers (mlp, shaped links)", fontsize=9)
fig.tight_layout()
fig.savefig(out / "scaling.png", dpi=100)
print("ms per step:", {name: [round(v, 1) for v in ms] for name, ms in series.items()})
print(f"wrote {out / 'scaling.png'}")
PY

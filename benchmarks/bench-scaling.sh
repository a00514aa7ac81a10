#!/usr/bin/env bash
# When to leave the single server: step time against the number of workers on slow links, one
# server rank against colocated servers, dense and compressed (docs/benchmarks.md, "One server or colocated").
# Usage: sudo bash benchmarks/bench-scaling.sh [OUT_DIR] [BANDWIDTH] [WORKERS] [STEPS] [REPEAT]
#   defaults: bench-scaling 10mbit "2 4 8" 8 1 — shaped links need root. ResNet-20 at batch 8: a small
#   model keeps the run link-bound (N ranks share this machine's cores), and its 21 layers of
#   similar size spread over the serving ranks (a model with one dominant layer, like mlp, puts
#   every byte on that layer's owner whatever the topology).
set -euo pipefail
out=${1:-bench-scaling}
bandwidth=${2:-10mbit}
workers=${3:-2 4 8}
steps=${4:-8}
repeat=${5:-1}
here=$(cd "$(dirname "$0")/.." && pwd)
psgrad=${PSGRAD:-$here/.venv/bin/psgrad}
python=${PSGRAD_PYTHON:-$here/.venv/bin/python}
mkdir -p "$out"
codecs="none;none --topology colocated"
codecs+=";sign --feedback ef --down-codec sign;sign --feedback ef --down-codec sign --topology colocated"
for n in $workers; do
  "$psgrad" bench --model resnet20 --batch-size 8 --steps "$steps" --warmup-steps 2 --repeat "$repeat" --workers "$n" \
    --bandwidth "$bandwidth" --codecs "$codecs" --baselines compute --json "$out/workers-$n.json" | tee "$out/workers-$n.txt"
done
"$python" - "$out" "$bandwidth" $workers <<'PY'
import json, sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

out, bandwidth, counts = Path(sys.argv[1]), sys.argv[2], [int(n) for n in sys.argv[3:]]
series: dict[str, list[float]] = {}
for n in counts:
    for row in json.loads((out / f"workers-{n}.json").read_text()):
        name = row["codec"]
        name = name.replace(" --topology colocated", " (colocated)") if "colocated" in name else (
            name if name == "compute" else f"{name} (1 server rank)"
        )
        series.setdefault(name, []).append(1000 / row["it_per_s"])
fig, ax = plt.subplots(figsize=(9, 4))
for name, ms in series.items():
    ax.plot(counts, ms, marker="o", label=name, linestyle=":" if name == "compute" else "-")
ax.set_xlabel("workers")
ax.set_ylabel("ms per step")
ax.set_xticks(counts)
ax.set_yscale("log")
ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
ax.set_title(f"step time vs workers: ResNet-20, batch 8, {bandwidth} links, 2 cores", fontsize=9)
fig.tight_layout()
fig.savefig(out / "scaling.png", dpi=100)
print("ms per step:", {name: [round(v, 1) for v in ms] for name, ms in series.items()})
print(f"wrote {out / 'scaling.png'}")
PY

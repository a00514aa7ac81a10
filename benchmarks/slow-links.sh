#!/usr/bin/env bash
# WRN-16-4, 2 colocated ranks x batch 16, at 10 Mbit/s and 1 Mbit/s: local steps (--local-steps 32,
# PowerSGD rank 8 or QSGD-16 with error feedback and a 64- or 16-level down-link, with and without
# --overlap-exchange) against the best per-step row and DDP with torch's PowerSGD hook, as
# fractions of compute-only speed measured in the same run, two rounds through every row (a VM's
# speed drifts within a run), medians (docs/benchmarks.md, "Slow links").
# Usage: bash benchmarks/slow-links.sh [OUT_DIR] [NETWORKS]   (needs root: shaped links;
# NETWORKS defaults to "10mbit 1mbit")
set -euo pipefail
out=${1:-slow-links}
networks=${2:-10mbit 1mbit}
here=$(cd "$(dirname "$0")/.." && pwd)
psgrad=${PSGRAD:-$here/.venv/bin/psgrad}
mkdir -p "$out"
rows="powersgd:rank=2 --topology colocated --push after"
rows+=";powersgd:rank=8 --topology colocated --local-steps 32"
rows+=";powersgd:rank=8 --topology colocated --local-steps 32 --overlap-exchange"
rows+=";qsgd:levels=16 --feedback ef --down-codec qsgd:levels=64 --topology colocated --local-steps 32"
rows+=";qsgd:levels=16 --feedback ef --down-codec qsgd:levels=16 --topology colocated --local-steps 32"
rows+=";qsgd:levels=16 --feedback ef --down-codec qsgd:levels=16 --topology colocated --local-steps 32 --overlap-exchange"
for net in $networks; do
  extra=""
  # a dense exchange or reply of WRN-16-4 (11 MB) takes 9 s at 10 Mbit/s, 90 s at 1 Mbit/s: only at 10
  [ "$net" = 1mbit ] || extra=";none --topology colocated --local-steps 32;qsgd:levels=16 --feedback ef --topology colocated --local-steps 32"
  # 32 steps left out, then 128 measured: four exchanges of 32 steps
  "$psgrad" bench --model wrn --depth 16 --widen-factor 4 --batch-size 16 --steps 128 --warmup-steps 32 --repeat 2 \
    --codecs "$rows$extra" --baselines compute,ddp-powersgd --bandwidth "$net" \
    --job-timeout 1800 --json "$out/$net.json" | tee "$out/$net.txt"
done

#!/usr/bin/env bash
# WRN-16-4 with 1 server + 2 workers at loopback, 1 Gbit/s and 100 Mbit/s: psgrad bench's rows and baselines per network.
# Usage: bash benchmarks/bench-wrn.sh [OUT_DIR] [STEPS] [REPEAT] [NETWORKS]   (shaped runs need root;
# NETWORKS defaults to "loopback 1gbit 100mbit"; how bench measures: docs/benchmarks.md)
set -euo pipefail
out=${1:-bench-wrn}
steps=${2:-10}
repeat=${3:-2}
networks=${4:-loopback 1gbit 100mbit}
here=$(cd "$(dirname "$0")/.." && pwd)
psgrad=${PSGRAD:-$here/.venv/bin/psgrad}
mkdir -p "$out"
codecs="none"
codecs+=";fp16 --down-codec fp16"
codecs+=";qsgd:levels=16 --down-codec qsgd:levels=16"
codecs+=";topk:ratio=0.01,approx=1 --feedback ef --down-codec topk:ratio=0.01,approx=1"
codecs+=";sign --feedback ef --down-codec sign"
codecs+=";sign --feedback ef --down-codec qsgd:levels=16"
codecs+=";svd:rank=2 --feedback ef --down-codec svd:rank=2"
for net in $networks; do
  shape=()
  [ "$net" = loopback ] || shape=(--bandwidth "$net")
  "$psgrad" bench --model wrn --depth 16 --widen-factor 4 --batch-size 16 --steps "$steps" --warmup-steps 3 \
    --repeat "$repeat" --codecs "$codecs" --baselines compute,ddp,ddp-powersgd "${shape[@]}" \
    --json "$out/$net.json" --plot "$out/$net.png" | tee "$out/$net.txt"
done

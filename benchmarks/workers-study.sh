#!/usr/bin/env bash
# Accuracy against the number of workers, simulated in one process (psgrad simulate; docs/training.md,
# "Many workers in one process"). The total batch stays 256 whatever N is (each worker takes
# 256/N), so every run trains the same samples with the same steps and learning rate: what changes
# with N is only how many independently coded gradients make up each step.
# Usage: bash benchmarks/workers-study.sh [OUT_DIR] [WORKERS] [EPOCHS] [CODEC ...]
#   defaults: workers-study "2 4 8 16 32 64" 15, codecs "none", "topk:ratio=0.01 --feedback ef" and
#   "topk:ratio=0.01 --feedback dgc --momentum 0 --dgc-warmup-epochs 3" (about 50 minutes on 2 cores).
set -euo pipefail
out=${1:-workers-study}
workers=${2:-2 4 8 16 32 64}
epochs=${3:-15}
shift $(($# < 3 ? $# : 3))
codecs=("$@")
[ ${#codecs[@]} -gt 0 ] || codecs=("none" "topk:ratio=0.01 --feedback ef" "topk:ratio=0.01 --feedback dgc --momentum 0 --dgc-warmup-epochs 3")
here=$(cd "$(dirname "$0")/.." && pwd)
psgrad=${PSGRAD:-$here/.venv/bin/psgrad}
mkdir -p "$out"
for codec in "${codecs[@]}"; do
  name=$(echo "$codec" | tr -c 'a-zA-Z0-9=.\n' '_')
  for n in $workers; do
    dir="$out/$name-$n"
    [ -f "$dir/eval.csv" ] && continue # done before: the study resumes where it stopped
    # shellcheck disable=SC2086 # the codec's own options split into words on purpose
    "$psgrad" simulate --workers "$n" --model wrn --depth 10 --widen-factor 1 --dataset proxy \
      --batch-size $((256 / n)) --lr 0.2 --epochs "$epochs" --schedule cosine --eval-every-epochs "$epochs" \
      --no-progress --codec $codec --log-dir "$dir" --overwrite 2>"$dir.log" || { tail -5 "$dir.log"; exit 1; }
  done
done
printf '| codec | %s |\n|---|%s\n' "$(echo $workers | sed 's/ / | /g')" "$(for _ in $workers; do printf -- '---|'; done)"
for codec in "${codecs[@]}"; do
  name=$(echo "$codec" | tr -c 'a-zA-Z0-9=.\n' '_')
  row="| $codec |"
  for n in $workers; do
    row+=" $(tail -1 "$out/$name-$n/eval.csv" | awk -F, '{printf "%.3f", $4}') |"
  done
  echo "$row"
done
echo "(final test accuracy on proxy (synthetic); total batch 256, WRN-10-1, $epochs epochs, cosine from lr 0.2)"

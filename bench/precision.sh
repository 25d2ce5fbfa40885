#!/bin/bash
# What mixed precision does to accuracy (docs/memory.md, "Mixed precision"): bench/convergence's
# fixed runs on 2 workers (keep_global_batch, no resize) under each DataParallelOptions::
# mixed_precision, same seeds, side by side in one run. Prints one line per run and a table of
# the final test accuracy and loss (mean, min, max over seeds) and the wall time per run. The
# raw lines go to RAW (default bench/results/precision-<UTC time>.txt).
#
#   bash bench/precision.sh [build] [seeds] [models]      # defaults: build, "0 1 2", "cnn gpt"
set -euo pipefail
build=${1:-build}
seeds=${2:-0 1 2}
models=${3:-cnn gpt}
precisions="fp32 bf16 bf16-reduce bf16-all fp16-reduce"
out=${RAW:-bench/results/precision-$(date -u +%Y%m%dT%H%MZ).txt}
: > "$out"
for model in $models; do
  if [ "$model" = gpt ]; then args="--model gpt --batch 16 --lr 0.01 --epochs 12 --limit 960"; else args="--epochs 3"; fi
  for seed in $seeds; do
    for p in $precisions; do
      start=$(date +%s.%N)
      line=$("$build/bin/shoal" run -n 2 --no-tag-output "$build/bench/convergence" $args \
        --seed "$seed" --precision "$p" --eval-every 1000000000 2>&1 | grep '^final')
      end=$(date +%s.%N)
      echo "$model $p seed $seed $line seconds $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.9f", b - a }')" | tee -a "$out"
    done
  done
done
echo
echo "model precision   runs  accuracy mean (min .. max)    test loss mean (min .. max)   s/run"
awk '{
  for (i = 1; i <= NF; ++i) { if ($i == "accuracy") a = $(i + 1); if ($i == "loss") l = $(i + 1); if ($i == "seconds") t = $(i + 1) }
  k = $1 " " $2; n[k]++; sa[k] += a; sl[k] += l; st[k] += t
  if (!(k in mina) || a < mina[k]) mina[k] = a; if (!(k in maxa) || a > maxa[k]) maxa[k] = a
  if (!(k in minl) || l < minl[k]) minl[k] = l; if (!(k in maxl) || l > maxl[k]) maxl[k] = l
  if (!(k in order)) { order[k] = ++count; keys[count] = k }
} END {
  for (c = 1; c <= count; ++c) { k = keys[c]; split(k, f, " ")
    printf "%-5s %-12s %4d  %.4f (%.4f .. %.4f)     %.4f (%.4f .. %.4f)      %.1f\n", f[1], f[2], n[k],
      sa[k] / n[k], mina[k], maxa[k], sl[k] / n[k], minl[k], maxl[k], st[k] / n[k] }
}' "$out"

#!/usr/bin/env bash
# What SHOAL_TIMELINE costs a DataParallel step loop (docs/runtime.md, "Timeline"): bench/ddp
# (--impl shoal) under `shoal run -n 2`, one intra-op thread per worker, with the timeline off and
# on in turns within each round (the order rotates), medians over rounds. Two bucket sizes: 25 MB
# (PyTorch's default: one or two all-reduces a step) and 0.25 MB (tens of all-reduces a step, so
# that the cost per recorded event shows). Prints, per model and bucket size, samples/s off and
# on, their ratio, and the events each worker recorded per step.
#
#   bench/timeline.sh [BUILD_DIR]      (default: build; needs its targets shoal_cli and ddp)
#
# Environment: ROUNDS=5 STEPS=20 WARMUP=3 MODELS="mlp cnn" BUCKETS="25 0.25" RUN_TIMEOUT=300
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
shoal=$(realpath "$build/bin/shoal")
bench=$(realpath "$build/bench/ddp")
rounds=${ROUNDS:-5}
steps=${STEPS:-20}
warmup=${WARMUP:-3}
models=${MODELS:-mlp cnn}
buckets=${BUCKETS:-25 0.25}
run_timeout=${RUN_TIMEOUT:-300}
work=$(mktemp -d /tmp/shoal-bench-timeline-XXXXXX)
trap 'rm -rf "$work"' EXIT

# Runs one contender ($1 model, $2 bucket MB, $3 off|on); prints samples/s, and for "on" the
# events per step per worker after a space.
run() {
  local model=$1 bucket=$2 mode=$3 line trace=$work/trace.json
  rm -f "$trace"
  if [[ $mode == on ]]; then export SHOAL_TIMELINE=$trace; else unset SHOAL_TIMELINE; fi
  line=$(SHOAL_NUM_THREADS=1 timeout "$run_timeout" "$shoal" run -n 2 --no-tag-output \
    "$bench" --impl shoal --model "$model" --warmup "$warmup" --steps "$steps" --bucket-mb "$bucket" |
    grep '^ddp ')
  local rate=${line#*samples_per_s=}
  rate=${rate%% *}
  if [[ $mode == on ]]; then
    local events
    events=$(grep -c '"ph":"X"' "$trace")
    echo "$rate $(awk -v e="$events" -v s="$((steps + warmup))" 'BEGIN { printf "%.1f", e / 2 / s }')"
  else
    echo "$rate"
  fi
  unset SHOAL_TIMELINE
}

median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

printf '%-5s %-9s %12s %12s %9s %16s\n' model bucket_mb off_samp/s on_samp/s on/off events/step
for model in $models; do
  for bucket in $buckets; do
    off=() on=() events=""
    for ((round = 0; round < rounds; ++round)); do
      order=(off on)
      ((round % 2)) && order=(on off)
      for mode in "${order[@]}"; do
        result=$(run "$model" "$bucket" "$mode")
        if [[ $mode == on ]]; then
          on+=("${result%% *}")
          events=${result#* }
        else
          off+=("$result")
        fi
      done
    done
    off_median=$(printf '%s\n' "${off[@]}" | median)
    on_median=$(printf '%s\n' "${on[@]}" | median)
    printf '%-5s %-9s %12.2f %12.2f %9.3f %16s\n' "$model" "$bucket" "$off_median" "$on_median" \
      "$(awk -v a="$on_median" -v b="$off_median" 'BEGIN { print a / b }')" "$events"
  done
done

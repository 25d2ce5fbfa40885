#!/usr/bin/env bash
# The character-level GPT (examples/global_gpt.cpp) in every plan: its step time and the bytes
# each worker sends per step (shoal::comm::sent_bytes(): every group's traffic, counted as ring
# algorithms send it; docs/comm.md). Each run trains 30 steps with --dropout 0 and --report;
# the plans run in alternating order, --rounds times, and the table gives the medians over
# rounds. Every worker of a distributed plan has one intra-op thread (shoal's default on 2
# cores); one process runs twice: with its default (all cores) and with one thread, the
# reference of the speed column. The check column compares every run's last loss with that
# run's (relative 1e-4): every plan trains the same model.
#
#   bench/gpt_plans.sh [--rounds N] [--layers N] [--build DIR]
#
# Builds nothing: expects DIR (default build/) to hold examples/global_gpt and bin/shoal.
# --layers (default 6) is the GPT's transformer blocks: 6 blocks and the two end layers make 8
# layers, enough for 4 workers of 2 interleaved stages each. Raw lines go to
# bench/results/gpt_plans-<date and time>.txt.
set -euo pipefail

usage() {
  echo "usage: bench/gpt_plans.sh [--rounds N] [--layers N] [--build DIR]" >&2
  exit 2
}

root=$(cd "$(dirname "$0")/.." && pwd)
rounds=3
layers=6
build=$root/build
while [[ $# -gt 0 ]]; do
  case $1 in
    --rounds) [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || {
      echo "gpt_plans.sh: --rounds: expected a number above 0, got '${2:-}'" >&2
      exit 2
    }; rounds=$2; shift 2 ;;
    --layers) [[ $# -ge 2 && $2 =~ ^[1-9][0-9]*$ ]] || {
      echo "gpt_plans.sh: --layers: expected a number above 0, got '${2:-}'" >&2
      exit 2
    }; layers=$2; shift 2 ;;
    --build) [[ $# -ge 2 ]] || usage; build=$(cd "$2" && pwd); shift 2 ;;
    *) echo "gpt_plans.sh: unknown option '$1'" >&2; usage ;;
  esac
done
gpt=$build/examples/global_gpt
shoal=$build/bin/shoal
for program in "$gpt" "$shoal"; do
  if [[ ! -x $program ]]; then
    echo "gpt_plans.sh: $program is missing; expected a build (cmake --build build --target" \
      "global_gpt shoal_cli)" >&2
    exit 2
  fi
done

# plan workers schedule micro-batches intra-op-threads (-: shoal's default)
configs=("one 1 - - -" "one 1 - - 1" "data 4 - - -" "tensor 4 - - -" "hybrid 4 - - -")
for workers in 2 4; do
  for schedule in gpipe 1f1b interleaved zb; do
    for m in 4 8; do configs+=("pipeline $workers $schedule $m -"); done
  done
done
for schedule in gpipe 1f1b interleaved zb; do configs+=("3d 8 $schedule 4 -"); done

mkdir -p "$root/bench/results"
raw=$root/bench/results/gpt_plans-$(date -u +%Y%m%dT%H%M%SZ).txt
log=$(mktemp)
trap 'rm -f "$log"' EXIT
{
  echo "# bench/gpt_plans.sh --rounds $rounds --layers $layers, $(date -u '+%F %T') UTC"
  echo "# $(nproc) cores, $(lscpu | sed -n 's/^Model name: *//p')"
  echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$raw"

for ((round = 1; round <= rounds; ++round)); do
  order=("${configs[@]}")
  if ((round % 2 == 0)); then  # alternate the order, so drift in the machine's load is shared
    order=()
    for ((i = ${#configs[@]} - 1; i >= 0; --i)); do order+=("${configs[i]}"); done
  fi
  for config in "${order[@]}"; do
    read -r plan workers schedule m threads <<<"$config"
    args=(--plan "$plan" --report --dropout 0 --steps 30 --layers "$layers")
    [[ $schedule != - ]] && args+=(--schedule "$schedule" --micro-batches "$m")
    environment=()
    [[ $threads != - ]] && environment=(SHOAL_NUM_THREADS="$threads")
    if ! env "${environment[@]}" timeout 600 "$shoal" run -n "$workers" "$gpt" "${args[@]}" \
      >"$log" 2>&1; then
      echo "gpt_plans.sh: round $round, $plan on $workers ($schedule, m=$m) failed:" >&2
      tail -n 20 "$log" >&2
      exit 1
    fi
    report=$(grep -o 'report .*' "$log" | tail -n 1)
    loss=$(grep -o 'step 30 loss [^ ]*' "$log" | tail -n 1 | cut -d' ' -f4)
    if [[ -z $report || -z $loss ]]; then
      echo "gpt_plans.sh: round $round, $plan on $workers printed no report or no step 30:" >&2
      tail -n 20 "$log" >&2
      exit 1
    fi
    echo "round=$round threads=$threads $report loss=$loss" | tee -a "$raw"
  done
done
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$raw"

# The table: medians over rounds.
python3 - "$raw" <<'EOF'
import statistics
import sys

path = sys.argv[1]
runs = {}
for line in open(path).read().splitlines():
    if line.startswith("#"):
        print(line)
        continue
    fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
    key = (fields["plan"], fields["workers"], fields["schedule"], fields["micro_batches"],
           fields["threads"])
    runs.setdefault(key, []).append(fields)

one = runs[("one", "1", "-", "-", "1")]
one_ms = statistics.median(float(r["step_ms"]) for r in one)
one_loss = statistics.median(float(r["loss"]) for r in one)
print()
print("| plan | workers | schedule | m | threads | step ms | speed vs one (1 thread) "
      "| KiB sent per step | peak stash | last loss vs one (1e-4) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for key, rs in runs.items():
    ms = statistics.median(float(r["step_ms"]) for r in rs)
    kib = statistics.median(float(r["sent_kib_per_step"]) for r in rs)
    stash = rs[0]["peak_stash"]
    worst = max(abs(float(r["loss"]) - one_loss) / abs(one_loss) for r in rs)
    check = "ok" if worst <= 1e-4 else f"FAIL ({worst:.1e})"
    print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | {ms:.1f} | {one_ms / ms:.2f} "
          f"| {kib:.1f} | {stash} | {check} |")
EOF

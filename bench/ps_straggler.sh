#!/usr/bin/env bash
# One straggler among parameter-server workers: bench/ps.cpp's MLP on W workers and S servers,
# worker 0 slowed by an added sleep per step (--slow-worker 0 --slow-ms X), in each consistency
# mode, beside the same run without the straggler, in one run of this script. Each worker reports
# its own samples/s over its own timed steps (in async the workers do not wait for each other);
# the healthy workers are 1..W-1 in both runs. Printed per mode, medians over rounds:
#   healthy    the healthy workers' summed samples/s, with the straggler / without
#   job        every worker's summed samples/s, with / without (set beside (W-1)/W)
#   straggler  the slow worker's own samples/s, with / without
# What a parameter server promises (docs/ps.md, "Consistency"): sync goes at the straggler's pace,
# async keeps the healthy workers' pace, bounded staleness (ssp:S) lets them run S steps ahead
# and then waits, so over N timed steps it sits between the two.
#
#   bench/ps_straggler.sh [BUILD_DIR]     (default: build; needs its targets shoal_cli and ps)
#
# Environment:
#   ROUNDS=2 WARMUP=3 STEPS=15    rounds; untimed and timed steps per run
#   WORKERS=3 SERVERS=2           the job
#   MODES="sync async ssp:1 ssp:3"
#   SLOW_MS=                      the straggler's sleep per step; empty: twice the per-worker step
#                                 time of a calibration run (async, no straggler), so that the
#                                 straggler's steps take about three times the others'
#   RAW=FILE                      raw lines (default bench/results/ps-straggler-DATE.txt)
#   RUN_TIMEOUT=300               seconds allowed to one run
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
shoal=$(realpath "$build/bin/shoal")
program=$(realpath "$build/bench/ps")
rounds=${ROUNDS:-2}
warmup=${WARMUP:-3}
steps=${STEPS:-15}
workers=${WORKERS:-3}
servers=${SERVERS:-2}
read -r -a modes <<<"${MODES:-sync async ssp:1 ssp:3}"
run_timeout=${RUN_TIMEOUT:-300}
for tool in "$shoal" "$program"; do
  [[ -x "$tool" ]] || { echo "ps_straggler.sh: $tool is missing; build the targets shoal_cli and ps" >&2; exit 2; }
done
((workers >= 2)) || { echo "ps_straggler.sh: WORKERS=$workers; expected at least 2" >&2; exit 2; }

results=$(mktemp -d /tmp/shoal-ps-straggler.XXXXXX)
mkdir -p "$here/results"
raw=${RAW:-$here/results/ps-straggler-$(date -u +%Y%m%dT%H%MZ).txt}

# One run; $1 mode, $2 slow ms (0: none), $3 log. Fails unless shoal run exits 0 and prints the
# per-worker lines.
run() {
  local status=0
  SHOAL_NUM_THREADS=1 SHOAL_PS_MODE=$1 timeout "$run_timeout" "$shoal" run --servers "$servers" \
    -n "$workers" --no-tag-output "$program" --warmup "$warmup" --steps "$steps" \
    --slow-worker 0 --slow-ms "$2" >"$3" 2>&1 || status=$?
  if [[ $status != 0 || $(grep -c '^ps-worker ' "$3") != "$workers" ]]; then
    echo "ps_straggler.sh: mode $1 slow-ms $2 failed (exit $status); last lines of $3:" >&2
    tail -5 "$3" | sed 's/^/  /' >&2
    return 1
  fi
}

echo "## machine"
echo "date: $(date -u)"
echo "cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "logs: $results; raw lines: $raw"

slow_ms=${SLOW_MS:-}
if [[ -z $slow_ms ]]; then
  run async 0 "$results/calibration.log"
  slow_ms=$(awk '/^ps-worker /{for(i=1;i<=NF;i++) if($i~/^step_ms=/){split($i,a,"=");s+=a[2];k++}}
                 END{printf "%d", 2*s/k}' "$results/calibration.log")
  echo "calibration (async, no straggler): per-worker step $((slow_ms / 2)) ms; SLOW_MS=$slow_ms"
fi
{
  echo "# bench/ps_straggler.sh raw lines: one per worker and run (round, mode, slow_ms, then the worker's line)"
  echo "# date: $(date -u); cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# ROUNDS=$rounds WARMUP=$warmup STEPS=$steps WORKERS=$workers SERVERS=$servers MODES=\"${modes[*]}\" SLOW_MS=$slow_ms"
} >"$raw"

# Each round runs every (mode, straggler or not) pair, in an order that rotates from round to
# round so that the machine's noise falls on all alike.
list=()
for mode in "${modes[@]}"; do list+=("$mode 0" "$mode $slow_ms"); done
n=${#list[@]}
for ((round = 0; round < rounds; round++)); do
  for ((i = 0; i < n; i++)); do
    read -r mode ms <<<"${list[(round + i) % n]}"
    log=$results/${mode/:/}-slow$ms-$round.log
    run "$mode" "$ms" "$log"
    grep '^ps-worker ' "$log" | sed "s/^/round=$round mode=$mode slow_ms=$ms /" | tee -a "$raw"
  done
  echo "# round $round done; load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$raw"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$raw" "$workers" <<'PY'
import statistics, sys
raw, w = sys.argv[1], int(sys.argv[2])
runs = {}  # (mode, slowed, round) -> {rank: samples/s}
order = []
for line in open(raw):
    if line.startswith("#"):
        continue
    f = dict(t.split("=", 1) for t in line.split() if "=" in t)
    key = (f["mode"], f["slow_ms"] != "0", f["round"])
    runs.setdefault(key, {})[int(f["rank"])] = float(f["samples_per_s"])
    if f["mode"] not in order:
        order.append(f["mode"])
def med(mode, slowed, pick):
    return statistics.median(pick(r) for (m, s, _), r in runs.items() if m == mode and s == slowed)
healthy = lambda r: sum(v for k, v in r.items() if k != 0)
job = lambda r: sum(r.values())
slow = lambda r: r[0]
print(f"\n## samples/s, median over rounds; W={w}, worker 0 the straggler")
print("| mode | healthy, without | healthy, with | healthy with/without | job with/without"
      f" ((W-1)/W = {(w - 1) / w:.2f}) | straggler's own with/without |")
print("|---|---:|---:|---:|---:|---:|")
for m in order:
    h0, h1 = med(m, False, healthy), med(m, True, healthy)
    print(f"| {m} | {h0:.1f} | {h1:.1f} | {h1 / h0:.2f} | "
          f"{med(m, True, job) / med(m, False, job):.2f} | "
          f"{med(m, True, slow) / med(m, False, slow):.2f} |")
PY

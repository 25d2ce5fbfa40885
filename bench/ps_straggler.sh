#!/usr/bin/env bash
# One straggler among parameter-server workers: bench/ps.cpp's MLP on W workers and S servers,
# in each consistency mode, worker 0 made a straggler two ways, beside the same run without a
# straggler, in one run of this script:
#   sleep   an added sleep in every step (--slow-worker 0 --slow-ms X)
#   stop    SIGSTOP for STOP_S seconds, STOP_AFTER seconds into the timed steps, then SIGCONT
#           (a worker paused by its machine: the others' pulls wait, within their deadline)
# Each worker reports
# its own samples/s over its own timed steps (in async the workers do not wait for each other);
# the healthy workers are 1..W-1 in every run. Printed per mode and straggler, medians over rounds:
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
#   ROUNDS=3 WARMUP=3 STEPS=15    rounds; untimed and timed steps per run
#   WORKERS=3 SERVERS=2           the job
#   MODES="sync async ssp:1 ssp:3"
#   SLOW_MS=                      the straggler's sleep per step; empty: twice the per-worker step
#                                 time of a calibration run (async, no straggler), so that the
#                                 straggler's steps take about three times the others'
#   STRAGGLERS="sleep stop"        which stragglers
#   STOP_AFTER=0.5 STOP_S=3         the stopped straggler's pause
#   RAW=FILE                      raw lines (default bench/results/ps-straggler-DATE.txt)
#   RUN_TIMEOUT=300               seconds allowed to one run
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
shoal=$(realpath "$build/bin/shoal")
program=$(realpath "$build/bench/ps")
rounds=${ROUNDS:-3}
warmup=${WARMUP:-3}
steps=${STEPS:-15}
workers=${WORKERS:-3}
servers=${SERVERS:-2}
read -r -a modes <<<"${MODES:-sync async ssp:1 ssp:3}"
read -r -a stragglers <<<"${STRAGGLERS:-sleep stop}"
stop_after=${STOP_AFTER:-0.5}
stop_s=${STOP_S:-3}
run_timeout=${RUN_TIMEOUT:-300}
for tool in "$shoal" "$program"; do
  [[ -x "$tool" ]] || { echo "ps_straggler.sh: $tool is missing; build the targets shoal_cli and ps" >&2; exit 2; }
done
((workers >= 2)) || { echo "ps_straggler.sh: WORKERS=$workers; expected at least 2" >&2; exit 2; }

results=$(mktemp -d /tmp/shoal-ps-straggler.XXXXXX)
mkdir -p "$here/results"
raw=${RAW:-$here/results/ps-straggler-$(date -u +%Y%m%dT%H%MZ).txt}

# The pid of worker 0 among the children of launcher $1 (its environment has SHOAL_RANK=0).
worker0_of() {
  local child
  for child in $(pgrep -P "$1"); do
    if tr '\0' '\n' <"/proc/$child/cmdline" 2>/dev/null | grep -qx "$program" &&
      tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -qx 'SHOAL_RANK=0'; then
      echo "$child"
      return 0
    fi
  done
  return 1
}

# One run; $1 mode, $2 straggler (none, sleep, stop), $3 log. Fails unless shoal run exits 0 and
# prints the per-worker lines.
run() {
  local status=0 job launcher worker deadline
  local slow=(--slow-worker 0 --slow-ms 0)
  [[ $2 == sleep ]] && slow=(--slow-worker 0 --slow-ms "$slow_ms")
  SHOAL_NUM_THREADS=1 SHOAL_PS_MODE=$1 timeout "$run_timeout" "$shoal" run --servers "$servers" \
    -n "$workers" --no-tag-output "$program" --warmup "$warmup" --steps "$steps" "${slow[@]}" \
    --step-times >"$3" 2>&1 &
  job=$!
  if [[ $2 == stop ]]; then
    deadline=$((SECONDS + 120))
    until grep -q '^ps-timed-start' "$3"; do
      if ! kill -0 "$job" 2>/dev/null || ((SECONDS >= deadline)); then break; fi
      sleep 0.05
    done
    sleep "$stop_after"
    if launcher=$(pgrep -P "$job") && worker=$(worker0_of "$launcher"); then
      kill -STOP "$worker"
      sleep "$stop_s"
      kill -CONT "$worker"
    else
      echo "ps_straggler.sh: mode $1: worker 0 not found to stop" >&2
      status=1
    fi
  fi
  wait "$job" || status=$?
  if [[ $status != 0 || $(grep -c '^ps-worker ' "$3") != "$workers" ]]; then
    echo "ps_straggler.sh: mode $1 straggler $2 failed (exit $status); last lines of $3:" >&2
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
  run async none "$results/calibration.log"
  slow_ms=$(awk '/^ps-worker /{for(i=1;i<=NF;i++) if($i~/^step_ms=/){split($i,a,"=");s+=a[2];k++}}
                 END{printf "%d", 2*s/k}' "$results/calibration.log")
  echo "calibration (async, no straggler): per-worker step $((slow_ms / 2)) ms; SLOW_MS=$slow_ms"
fi
{
  echo "# bench/ps_straggler.sh raw lines: two per worker and run (round, mode, straggler, slow_ms, then the worker's ps-worker and ps-steps lines)"
  echo "# date: $(date -u); cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# ROUNDS=$rounds WARMUP=$warmup STEPS=$steps WORKERS=$workers SERVERS=$servers MODES=\"${modes[*]}\" STRAGGLERS=\"${stragglers[*]}\" SLOW_MS=$slow_ms STOP_AFTER=$stop_after STOP_S=$stop_s"
} >"$raw"

# Each round runs every (mode, straggler) pair, in an order that rotates from round to round so
# that the machine's noise falls on all alike.
list=()
for mode in "${modes[@]}"; do
  list+=("$mode none")
  for straggler in "${stragglers[@]}"; do
    case $straggler in
      sleep | stop) list+=("$mode $straggler") ;;
      *) echo "ps_straggler.sh: unknown straggler $straggler; expected sleep or stop" >&2; exit 2 ;;
    esac
  done
done
n=${#list[@]}
for ((round = 0; round < rounds; round++)); do
  for ((i = 0; i < n; i++)); do
    read -r mode straggler <<<"${list[(round + i) % n]}"
    ms=0
    [[ $straggler == sleep ]] && ms=$slow_ms
    log=$results/${mode/:/}-$straggler-$round.log
    run "$mode" "$straggler" "$log"
    grep -E '^ps-(worker|steps) ' "$log" |
      sed "s/^/round=$round mode=$mode straggler=$straggler slow_ms=$ms /" >>"$raw"
    grep '^ps-worker ' "$log" | sed "s/^/round=$round mode=$mode straggler=$straggler /"
  done
  echo "# round $round done; load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$raw"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$raw" "$workers" <<'PY'
import statistics, sys
raw, w = sys.argv[1], int(sys.argv[2])
runs = {}  # (mode, straggler, round) -> {rank: samples/s}
longest = {}  # (mode, straggler, round) -> [(a healthy worker's longest step, its median step)]
modes, kinds = [], []
for line in open(raw):
    if line.startswith("#"):
        continue
    f = dict(t.split("=", 1) for t in line.split() if "=" in t)
    key = (f["mode"], f["straggler"], f["round"])
    if "end_ns" in f:  # a healthy worker's steps: the longest, and the median
        if int(f["rank"]) != 0:
            e = [int(t) for t in f["end_ns"].split(",")]
            gaps = sorted(b - a for a, b in zip(e, e[1:]))
            longest.setdefault(key, []).append((gaps[-1] / 1e6, statistics.median(gaps) / 1e6))
        continue
    runs.setdefault(key, {})[int(f["rank"])] = float(f["samples_per_s"])
    if f["mode"] not in modes:
        modes.append(f["mode"])
    if f["straggler"] != "none" and f["straggler"] not in kinds:
        kinds.append(f["straggler"])
rounds = sorted({r for (_, _, r) in runs})
healthy = lambda r: sum(v for k, v in r.items() if k != 0)
job = lambda r: sum(r.values())
slow = lambda r: r[0]
# The machine's load changes from minute to minute; a ratio is taken within a round, between runs
# made one after the other, and the median taken over rounds.
def ratio(mode, kind, pick):
    return statistics.median(pick(runs[(mode, kind, r)]) / pick(runs[(mode, "none", r)]) for r in rounds)
def median(mode, kind, pick):
    return statistics.median(pick(runs[(mode, kind, r)]) for r in rounds)
print(f"\n## W={w}, worker 0 the straggler; medians over {len(rounds)} rounds")
print("Ratios with the straggler / without it, each within a round; the last two columns within one")
print("run: the healthy workers' mean samples/s over the straggler's own, and their longest step")
print("beside their median step.\n")
print("| mode | straggler | healthy samples/s, without | with | healthy with/without | job with/without"
      f" ((W-1)/W = {(w - 1) / w:.2f}) | straggler's own with/without | healthy / straggler, same run |"
      " healthy's longest step, ms (median step) |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
for m in modes:
    for k in kinds:
        in_run = statistics.median(healthy(runs[(m, k, r)]) / (w - 1) / slow(runs[(m, k, r)]) for r in rounds)
        print(f"| {m} | {k} | {median(m, 'none', healthy):.1f} | {median(m, k, healthy):.1f} | "
              f"{ratio(m, k, healthy):.2f} | {ratio(m, k, job):.2f} | {ratio(m, k, slow):.2f} | {in_run:.2f} | "
              f"{statistics.median(a for r in rounds for a, _ in longest[(m, k, r)]):.0f} "
              f"({statistics.median(b for r in rounds for _, b in longest[(m, k, r)]):.0f}) |")
PY

#!/usr/bin/env bash
# Server failover time with replicas: bench/ps.cpp's MLP under
# `shoal run --servers S --ps-replicas 2 -n W`; in the middle of the timed steps this script
# SIGKILLs the primary of one server index (found among the launcher's children by its command
# line, `shoal ps-server --index I --replicas ...`, as tests/shoal_run.h's find_child does) and
# sets the time of the kill beside the wall-clock time at which every worker's steps ended
# (bench/ps.cpp --step-times). Per kill it reports:
#   failover   from the kill to the end of the first step that every worker completed after it
#   step       the median step time before the kill, and the longest step of any worker that
#              spans the kill (its excess over the median is what the failover cost)
# The kill falls anywhere in a step, so the failover time includes what was left of that step.
# and the median and maximum over KILLS runs (each a fresh job; the killed index alternates).
# docs/ps.md, "Replicas and snapshots", says what happens in between.
#
#   bench/ps_failover.sh [BUILD_DIR]     (default: build; needs its targets shoal_cli and ps)
#
# Environment:
#   KILLS=5 WARMUP=3 STEPS=40        runs (one kill each); untimed and timed steps per run
#   WORKERS=2 SERVERS=2 MODE=sync    the job (SHOAL_PS_MODE)
#   KILL_AFTER=1.5                   seconds after the timed steps begin
#   RAW=FILE                         raw lines (default bench/results/ps-failover-DATE.txt)
#   RUN_TIMEOUT=300                  seconds allowed to one run
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
shoal=$(realpath "$build/bin/shoal")
program=$(realpath "$build/bench/ps")
kills=${KILLS:-5}
warmup=${WARMUP:-3}
steps=${STEPS:-40}
workers=${WORKERS:-2}
servers=${SERVERS:-2}
mode=${MODE:-sync}
kill_after=${KILL_AFTER:-1.5}
run_timeout=${RUN_TIMEOUT:-300}
for tool in "$shoal" "$program"; do
  [[ -x "$tool" ]] || { echo "ps_failover.sh: $tool is missing; build the targets shoal_cli and ps" >&2; exit 2; }
done

results=$(mktemp -d /tmp/shoal-ps-failover.XXXXXX)
mkdir -p "$here/results"
raw=${RAW:-$here/results/ps-failover-$(date -u +%Y%m%dT%H%MZ).txt}
echo "## machine"
echo "date: $(date -u)"
echo "cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "logs: $results; raw lines: $raw"
{
  echo "# bench/ps_failover.sh raw lines: per run, the kill and then each worker's step end times"
  echo "# date: $(date -u); cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# KILLS=$kills WARMUP=$warmup STEPS=$steps WORKERS=$workers SERVERS=$servers MODE=$mode KILL_AFTER=$kill_after"
} >"$raw"

# The pid of the primary parameter server of index $2 among the children of launcher $1.
primary_of() {
  local child cmd
  for child in $(pgrep -P "$1"); do
    cmd=$(tr '\0' ' ' <"/proc/$child/cmdline" 2>/dev/null || true)
    if [[ $cmd == *" ps-server "* && $cmd == *" --index $2 --replicas "* ]]; then
      echo "$child"
      return 0
    fi
  done
  return 1
}

fail() {
  echo "ps_failover.sh: run $r: $1; last lines of $log:" >&2
  tail -5 "$log" | sed 's/^/  /' >&2
  exit 1
}

for ((r = 0; r < kills; r++)); do
  index=$((r % servers))
  log=$results/run-$r.log
  SHOAL_NUM_THREADS=1 SHOAL_PS_MODE=$mode timeout "$run_timeout" "$shoal" run --servers "$servers" \
    --ps-replicas 2 -n "$workers" --no-tag-output "$program" --warmup "$warmup" \
    --steps "$steps" --step-times >"$log" 2>&1 &
  job=$!
  deadline=$((SECONDS + 120))
  until grep -q '^ps-timed-start' "$log"; do
    kill -0 "$job" 2>/dev/null || fail "the job ended before its timed steps"
    ((SECONDS < deadline)) || { kill "$job"; fail "no timed steps within 120 s"; }
    sleep 0.05
  done
  sleep "$kill_after"
  launcher=$(pgrep -P "$job") || fail "no launcher under timeout's pid $job"
  primary=$(primary_of "$launcher" "$index") || fail "no primary of server $index among the launcher's children"
  kill_ns=$(date +%s%N)
  kill -KILL "$primary"
  status=0
  wait "$job" || status=$?
  [[ $status == 0 ]] || fail "shoal run exited $status"
  grep -q "parameter server $index was killed by signal 9" "$log" ||
    fail "the launcher did not report the primary of server $index killed"
  [[ $(grep -c '^ps-steps ' "$log") == "$workers" ]] || fail "not every worker printed its steps"
  echo "kill=$r index=$index kill_ns=$kill_ns" | tee -a "$raw"
  grep '^ps-steps ' "$log" | sed "s/^/kill=$r /" >>"$raw"
  grep "parameter server $index was killed" "$log" | sed 's/^/# /' | tee -a "$raw"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$raw" <<'PY'
import statistics, sys
kills, steps = {}, {}
for line in open(sys.argv[1]):
    if line.startswith("#"):
        continue
    f = dict(t.split("=", 1) for t in line.split() if "=" in t)
    if "kill_ns" in f:
        kills[f["kill"]] = (int(f["index"]), int(f["kill_ns"]))
    else:
        steps.setdefault(f["kill"], []).append([int(t) for t in f["end_ns"].split(",")])
print("\n## per kill (ms)")
print("| run | server | failover: kill to a step every worker completed | median step before | longest step spanning the kill | spanning - before |")
print("|---:|---:|---:|---:|---:|---:|")
fo, span, before = [], [], []
for k, (index, t) in kills.items():
    ends = steps[k]
    if not all(e[-1] > t for e in ends) or not all(e[0] < t for e in ends):
        sys.exit(f"run {k}: the kill did not fall inside every worker's timed steps; change KILL_AFTER")
    done = max(next(x for x in e if x > t) for e in ends)
    spanning = max(next(x for x in e if x > t) - max(x for x in e if x < t) for e in ends)
    gaps = [b - a for e in ends for a, b in zip(e, e[1:]) if b < t]
    normal = statistics.median(gaps) / 1e6 if gaps else float("nan")
    fo.append((done - t) / 1e6); span.append(spanning / 1e6); before.append(normal)
    print(f"| {k} | {index} | {fo[-1]:.1f} | {normal:.1f} | {span[-1]:.1f} | {span[-1] - normal:.1f} |")
print(f"\nfailover: median {statistics.median(fo):.1f} ms, max {max(fo):.1f} ms over {len(fo)} kills; "
      f"step before the kill: median {statistics.median(before):.1f} ms; "
      f"step spanning the kill: median {statistics.median(span):.1f} ms, max {max(span):.1f} ms")
PY

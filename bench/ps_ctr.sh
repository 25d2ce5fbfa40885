#!/usr/bin/env bash
# The CTR model of examples/ctr.cpp with large tables (bench/ps_ctr.cpp), trained with its tables
# on parameter servers (ps::Embedding: a step moves the rows it touched) and with DataParallel
# all-reducing the tables' dense gradients (every worker holds the whole tables), side by side in
# one run on loopback, for W workers and S servers. Prints per contender the samples/s (median
# over rounds) and the bytes one worker moves per step, computed from what the program observes
# (bench/ps_ctr.cpp says how), and each beside DataParallel's at the same W.
#
#   bench/ps_ctr.sh [BUILD_DIR]      (default: build; needs its targets shoal_cli and ps_ctr)
#
# Environment:
#   ROUNDS=2 WARMUP=3 STEPS=20 BATCH=512   rounds; untimed and timed steps; samples per worker
#   VOCABULARY=100000                      ids per field (26 fields; 100,000 gives 2.6 million
#                                          rows of 1 + 8 floats, 94 MB, as examples/ctr.cpp)
#   WORKERS="2 4" SERVERS="1 2"            the grid (dp runs once per W: it has no servers)
#   CONTENDERS="ps-sync ps-async dp"
#   RAW=FILE                               raw lines (default bench/results/ps-ctr-DATE.txt)
#   RUN_TIMEOUT=300                        seconds allowed to one run
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
shoal=$(realpath "$build/bin/shoal")
program=$(realpath "$build/bench/ps_ctr")
rounds=${ROUNDS:-2}
warmup=${WARMUP:-3}
steps=${STEPS:-20}
batch=${BATCH:-512}
vocabulary=${VOCABULARY:-100000}
read -r -a workers_grid <<<"${WORKERS:-2 4}"
read -r -a servers_grid <<<"${SERVERS:-1 2}"
read -r -a contenders <<<"${CONTENDERS:-ps-sync ps-async dp}"
run_timeout=${RUN_TIMEOUT:-300}
for tool in "$shoal" "$program"; do
  [[ -x "$tool" ]] || { echo "ps_ctr.sh: $tool is missing; build the targets shoal_cli and ps_ctr" >&2; exit 2; }
done
for contender in "${contenders[@]}"; do
  case $contender in
    ps-sync | ps-async | dp) ;;
    *) echo "ps_ctr.sh: unknown contender $contender; expected ps-sync, ps-async or dp" >&2; exit 2 ;;
  esac
done

results=$(mktemp -d /tmp/shoal-ps-ctr.XXXXXX)
mkdir -p "$here/results"
raw=${RAW:-$here/results/ps-ctr-$(date -u +%Y%m%dT%H%MZ).txt}
echo "## machine"
echo "date: $(date -u)"
echo "cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "logs: $results; raw lines: $raw"
{
  echo "# bench/ps_ctr.sh raw lines: one per run (round, contender, then the run's line)"
  echo "# date: $(date -u); cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# ROUNDS=$rounds WARMUP=$warmup STEPS=$steps BATCH=$batch VOCABULARY=$vocabulary WORKERS=\"${workers_grid[*]}\" SERVERS=\"${servers_grid[*]}\" CONTENDERS=\"${contenders[*]}\""
} >"$raw"

run() {  # $1 contender, $2 workers, $3 servers
  local args=(--warmup "$warmup" --steps "$steps" --batch "$batch" --vocabulary "$vocabulary")
  case $1 in
    dp) SHOAL_NUM_THREADS=1 timeout "$run_timeout" "$shoal" run -n "$2" --no-tag-output \
          "$program" --impl dp "${args[@]}" ;;
    ps-*) SHOAL_NUM_THREADS=1 SHOAL_PS_MODE=${1#ps-} timeout "$run_timeout" "$shoal" run \
            --servers "$3" -n "$2" --no-tag-output "$program" --impl ps "${args[@]}" ;;
  esac
}

failed=0
for ((round = 0; round < rounds; round++)); do
  for w in "${workers_grid[@]}"; do
    list=()
    for contender in "${contenders[@]}"; do
      if [[ $contender == dp ]]; then list+=("dp -"); else
        for s in "${servers_grid[@]}"; do list+=("$contender $s"); done
      fi
    done
    n=${#list[@]}
    for ((i = 0; i < n; i++)); do
      read -r contender s <<<"${list[(round + i) % n]}"
      log=$results/$contender-w$w-s$s-$round.log
      status=0
      run "$contender" "$w" "$s" >"$log" 2>&1 || status=$?
      line=$(grep -m1 '^ps-ctr ' "$log" || true)
      if [[ $status != 0 || -z $line ]]; then
        echo "# round=$round contender=$contender workers=$w servers=$s failed (exit $status); last lines of $log:" | tee -a "$raw"
        tail -5 "$log" | sed 's/^/#   /' | tee -a "$raw"
        failed=1
      else
        echo "round=$round contender=$contender $line" | tee -a "$raw"
      fi
    done
  done
  echo "# round $round done; load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$raw"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$raw" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    if line.startswith("#"):
        continue
    f = dict(t.split("=", 1) for t in line.split() if "=" in t)
    runs.setdefault((int(f["workers"]), f["servers"], f["contender"]), []).append(f)
med = lambda rs, k: statistics.median(float(r[k]) for r in rs)
print("\n## per step and worker; samples/s median over rounds")
print("| workers | servers | contender | samples/s | / dp | step ms | distinct ids | MB moved per worker | / dp |")
print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
for (w, s, c), rs in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][2] != "dp", kv[0][1], kv[0][2])):
    dp = runs.get((w, "-", "dp"))
    sps, mb = med(rs, "samples_per_s"), med(rs, "bytes_per_step") / 1e6
    r1 = f"{sps / med(dp, 'samples_per_s'):.2f}" if dp and c != "dp" else ""
    r2 = f"{mb / (med(dp, 'bytes_per_step') / 1e6):.4f}" if dp and c != "dp" and w > 1 else ""
    d = f"{med(rs, 'distinct_ids'):.0f}" if c != "dp" else ""
    print(f"| {w} | {s} | {c} | {sps:.0f} | {r1} | {med(rs, 'step_ms'):.1f} | {d} | {mb:.2f} | {r2} |")
PY
exit $failed

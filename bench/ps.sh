#!/usr/bin/env bash
# Parameter-server training throughput on bench/ddp's dense MLP (784-2048-2048-10, batch 64 per
# worker, SGD lr 0.01, one intra-op thread per process), side by side in one run on loopback:
#   shoal-ps-sync, shoal-ps-async   shoal's parameter server: bench/ps.cpp, shoal::ps::Optimizer under
#                      `shoal run --servers S -n W`, SHOAL_PS_MODE=sync|async
#   shoal-ps-sync-noise  the same in sync, measuring the gradient noise (--measure-noise; docs/ps.md,
#                      "Gradient noise"); not in the default list
#   dp                 shoal's all-reduce DataParallel (bench/ddp.cpp --impl shoal; no servers)
#   local              every worker trains alone, no communication (bench/ddp.cpp --impl local): the
#                      bound for every contender on this machine
#   torch-tutorial     PyTorch's RPC parameter server as its tutorial writes it (bench/ps_torch_rpc.py
#                      --variant tutorial: the model and its forward/backward on one server, async)
#   torch-careful-sync, torch-careful-async
#                      PyTorch's RPC parameter server as a careful user writes it (--variant
#                      careful: servers hold the parameters and the optimizer, trainers compute
#                      locally and make one RPC per server and step: push gradients, get parameters)
# for W workers and S servers. Contenders take turns within each round in an order that rotates
# from round to round, so that the machine's noise falls on all alike; the table shows medians
# over rounds of samples/s (every worker's samples over the slowest worker's timed steps, warm-up
# excluded, as bench/ddp).
#
#   bench/ps.sh [BUILD_DIR]      (default: build; needs its targets shoal_cli, ddp and ps)
#
# Its siblings, each one command with its own table (docs/ps.md, "All-reduce or parameter
# server?"): bench/ps_ctr.sh (the CTR model's large tables on servers against all-reduced dense
# gradients), bench/ps_straggler.sh (one slow or stopped worker in sync, async and ssp:S) and
# bench/ps_failover.sh (a primary server SIGKILLed under --ps-replicas 2).
#
# Environment:
#   ROUNDS=3 WARMUP=3 STEPS=10    rounds; untimed and timed steps per run
#   WORKERS="2 4" SERVERS="1 2"   the grid (dp runs once per W: it has no servers; the tutorial
#                                 only with S = 1: it has one server)
#   CONTENDERS="shoal-ps-sync shoal-ps-async dp local torch-tutorial torch-careful-sync torch-careful-async"
#   RAW=FILE                      the raw result lines (default bench/results/ps-DATE.txt)
#   RUN_TIMEOUT=300               seconds allowed to one run
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
shoal=$(realpath "$build/bin/shoal")
ddp=$(realpath "$build/bench/ddp")
python=/usr/bin/python3  # Debian's python3-torch; the python3 on PATH may have no torch
rounds=${ROUNDS:-3}
warmup=${WARMUP:-3}
steps=${STEPS:-10}
read -r -a workers_grid <<<"${WORKERS:-2 4}"
read -r -a servers_grid <<<"${SERVERS:-1 2}"
read -r -a contenders <<<"${CONTENDERS:-shoal-ps-sync shoal-ps-async dp local torch-tutorial torch-careful-sync torch-careful-async}"
run_timeout=${RUN_TIMEOUT:-300}

for tool in "$shoal" "$ddp"; do
  [[ -x "$tool" ]] || { echo "ps.sh: $tool is missing; build the targets shoal_cli and ddp" >&2; exit 2; }
done
"$python" -c 'import torch.distributed.rpc as r; assert r.is_available()' 2>/dev/null ||
  { echo "ps.sh: $python has no torch.distributed.rpc; install python3-torch" >&2; exit 2; }
for contender in "${contenders[@]}"; do
  case $contender in
    shoal-ps-sync | shoal-ps-sync-noise | shoal-ps-async | dp | local | torch-tutorial | torch-careful-sync | torch-careful-async) ;;
    *) echo "ps.sh: unknown contender $contender" >&2; exit 2 ;;
  esac
done

# shoal's parameter server: bench/ps.cpp trains the same MLP with shoal::ps::Optimizer and prints
#   ps impl=shoal-ps mode=sync workers=W servers=S batch=64 steps=N samples_per_s=... step_ms=...
# Without its build the rows are reported as not measured; nothing is printed in their place.
shoal_ps_program=$build/bench/ps
shoal_ps_run() {  # $1: sync|async|sync-noise, $2: workers, $3: servers
  if [[ ! -x $shoal_ps_program ]]; then
    echo "not measured: $shoal_ps_program is missing (build the target ps)"
    return 3
  fi
  local extra=()
  [[ $1 == *-noise ]] && extra=(--measure-noise)
  SHOAL_NUM_THREADS=1 SHOAL_PS_MODE=${1%-noise} timeout "$run_timeout" "$shoal" run --servers "$3" \
    -n "$2" --no-tag-output "$shoal_ps_program" --warmup "$warmup" --steps "$steps" "${extra[@]}"
}

results=$(mktemp -d /tmp/shoal-ps.XXXXXX)
mkdir -p "$here/results"
raw=${RAW:-$here/results/ps-$(date -u +%Y%m%dT%H%MZ).txt}
echo "## machine"
echo "date: $(date -u)"
echo "cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
echo "os: $(. /etc/os-release && echo "$PRETTY_NAME"); torch $("$python" -c 'import torch; print(torch.__version__)')"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "logs: $results; raw lines: $raw"
{
  echo "# bench/ps.sh raw lines: one per run (round, contender, then the run's line)"
  echo "# date: $(date -u); cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# ROUNDS=$rounds WARMUP=$warmup STEPS=$steps WORKERS=\"${workers_grid[*]}\" SERVERS=\"${servers_grid[*]}\" CONTENDERS=\"${contenders[*]}\""
} >"$raw"

port=29760
# One run: $1 contender, $2 workers, $3 servers; prints the run's result line on stdout.
run() {
  local contender=$1 w=$2 s=$3
  port=$((port + 1))  # a fresh port per run: no wait for the last run's sockets to close
  case $contender in
    dp | local)
      SHOAL_NUM_THREADS=1 timeout "$run_timeout" "$shoal" run -n "$w" --no-tag-output \
        "$ddp" --impl "${contender/dp/shoal}" --model mlp --warmup "$warmup" --steps "$steps" ;;
    torch-tutorial)
      timeout "$run_timeout" "$python" "$here/ps_torch_rpc.py" --variant tutorial --workers "$w" \
        --servers 1 --warmup "$warmup" --steps "$steps" --port "$port" ;;
    torch-careful-*)
      timeout "$run_timeout" "$python" "$here/ps_torch_rpc.py" --variant careful \
        --mode "${contender#torch-careful-}" --workers "$w" --servers "$s" --warmup "$warmup" \
        --steps "$steps" --port "$port" ;;
    shoal-ps-*) shoal_ps_run "${contender#shoal-ps-}" "$w" "$s" ;;
  esac
}

# Which (contender, servers) runs a round has for W workers: dp and local once, the tutorial with
# one server.
runs_for() {
  local w=$1 contender s
  for contender in "${contenders[@]}"; do
    case $contender in
      dp | local) echo "$contender -" ;;
      torch-tutorial) echo "torch-tutorial 1" ;;
      *) for s in "${servers_grid[@]}"; do echo "$contender $s"; done ;;
    esac
  done
}

for ((round = 0; round < rounds; round++)); do
  for w in "${workers_grid[@]}"; do
    mapfile -t list < <(runs_for "$w")
    n=${#list[@]}
    for ((i = 0; i < n; i++)); do
      read -r contender s <<<"${list[(round + i) % n]}"
      log=$results/$contender-w$w-s$s-$round.log
      status=0
      run "$contender" "$w" "${s/-/0}" >"$log" 2>&1 || status=$?
      line=$(grep -m1 -E '^(ps|ddp) ' "$log" || true)
      if [[ $status == 3 ]]; then
        echo "# round=$round contender=$contender workers=$w servers=$s $(tail -1 "$log")" | tee -a "$raw"
      elif [[ $status != 0 || -z $line ]]; then
        echo "# round=$round contender=$contender workers=$w servers=$s failed (exit $status); last lines of $log:" | tee -a "$raw"
        tail -5 "$log" | sed 's/^/#   /'
      else
        echo "round=$round contender=$contender workers=$w servers=$s $line" | tee -a "$raw"
      fi
    done
  done
  echo "# round $round done; load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$raw"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"

# Medians over rounds, and each contender beside PyTorch's careful parameter server and its
# tutorial's.
"$python" - "$raw" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    if line.startswith("#"):
        continue
    f = dict(t.split("=", 1) for t in line.split() if "=" in t)
    runs.setdefault((f["contender"], int(f["workers"]), f["servers"]), []).append(float(f["samples_per_s"]))
print("\n## samples/s, median over rounds (rounds)")
print("| workers | servers | contender | samples/s | rounds | / torch-careful (same mode, W, S) | / torch-tutorial (same W) |")
print("|---:|---:|---|---:|---:|---:|---:|")
for (c, w, s), v in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
    med = statistics.median(v)
    mode = "async" if c.endswith("async") else "sync"
    ref = runs.get((f"torch-careful-{mode}", w, s if s != "-" else "1"))
    ratio = f"{med / statistics.median(ref):.2f}" if ref and c not in ("dp", "local") and not c.startswith("torch-careful") else ""
    tutorial = runs.get(("torch-tutorial", w, "1"))
    over_tutorial = f"{med / statistics.median(tutorial):.2f}" if tutorial and not c.startswith("torch-") else ""
    print(f"| {w} | {s} | {c} | {med:.1f} | {len(v)} | {ratio} | {over_tutorial} |")
EOF

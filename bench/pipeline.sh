#!/usr/bin/env bash
# Pipeline parallelism (issue "pipeline parallelism", bench/RESULTS.md "pipeline"): a stack of
# equal layers, Linear(512, 512) + Tanh x 8 (LAYERS; ACTIVATION=none drops the Tanh), batch 1024
# (BATCH), forward and backward of the mean MSE loss, one intra-op thread per process
# (bench/pipeline.cpp), trained by
#   gpipe 1f1b interleaved zb   shoal::pipeline::Pipeline under that schedule (interleaved: v = 2),
#                               the stack cut into equal stages,
#   hand                        the same GPipe by hand in plain LibTorch with c10d send/recv,
#   local                       one process running the whole stack on the whole batch,
#   local-mb                    one process running the whole stack on the m micro-batches in turn
#                               (what the smaller matrix products alone cost),
# on p = 2 workers (one core each) and p = 4 (oversubscribed: 4 processes on 2 cores), for m in
# 2 4 8 16. Every shoal run records SHOAL_TIMELINE; bench/pipeline_trace.py reads from it the
# bubble, the compute costs and the stashed micro-batches, and shoal::pipeline::simulate() gives
# the theory at unit costs (f = 1, b = 2, i = w = 1) and at the costs the trace measured (one per
# kind; and, replayed by bench/pipeline_trace.py, each stage's own).
# Contenders take turns within each round in an order that rotates from round to round; the
# tables give medians over rounds. The load average is recorded before and after each round.
# One process (local, local-mb) runs only in the rounds of the first p.
#
#   bench/pipeline.sh [BUILD_DIR]      (default: build; needs its targets shoal_cli and pipeline)
#
# Environment: ROUNDS=3 STEPS=5 WARMUP=2 WORKERS="2 4" MICRO_BATCHES="2 4 8 16" BATCH=1024
#   LAYERS=8 ACTIVATION=tanh (or none)
#   CONTENDERS="gpipe 1f1b interleaved zb hand local local-mb" RUN_TIMEOUT=120
#   RAW=FILE   raw lines (default: bench/results/pipeline-DATE.txt, kept beside RESULTS.md)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
shoal=$(realpath "$build/bin/shoal")
bench=$(realpath "$build/bench/pipeline")
rounds=${ROUNDS:-3}
steps=${STEPS:-5}
warmup=${WARMUP:-2}
workers_list=${WORKERS:-2 4}
micro_batches_list=${MICRO_BATCHES:-2 4 8 16}
batch=${BATCH:-1024}
layers=${LAYERS:-8}
activation=${ACTIVATION:-tanh}
read -r -a contenders <<<"${CONTENDERS:-gpipe 1f1b interleaved zb hand local local-mb}"
run_timeout=${RUN_TIMEOUT:-120}
trace_py=$here/pipeline_trace.py
# Every contender runs with the malloc tunables that keep the heap (bench/malloc_tunables.sh says
# why); GLIBC_TUNABLES set by the caller wins.
source "$here/malloc_tunables.sh"

for tool in "$shoal" "$bench"; do
  [[ -x "$tool" ]] || { echo "pipeline.sh: $tool is missing; build the targets shoal_cli and pipeline" >&2; exit 2; }
done
for contender in "${contenders[@]}"; do
  case $contender in
    gpipe | 1f1b | interleaved | zb | hand | local | local-mb) ;;
    *) echo "pipeline.sh: unknown contender $contender; expected gpipe, 1f1b, interleaved, zb, hand, local or local-mb" >&2; exit 2 ;;
  esac
done

work=$(mktemp -d /tmp/shoal-bench-pipeline.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$here/results"
raw=${RAW:-$here/results/pipeline-$(date -u +%Y%m%dT%H%M%SZ).txt}
echo "## machine"
echo "date: $(date -u)"
echo "cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
echo "os: $(. /etc/os-release && echo "$PRETTY_NAME")"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "GLIBC_TUNABLES=$GLIBC_TUNABLES"
echo "raw lines: $raw"
{
  echo "# bench/pipeline.sh raw lines: one per run (round, contender, p, m, the program's line, the trace's, simulate()'s)"
  echo "# date: $(date -u); cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg); GLIBC_TUNABLES=$GLIBC_TUNABLES"
  echo "# ROUNDS=$rounds STEPS=$steps WARMUP=$warmup BATCH=$batch LAYERS=$layers ACTIVATION=$activation WORKERS=\"$workers_list\" MICRO_BATCHES=\"$micro_batches_list\" CONTENDERS=\"${contenders[*]}\""
} >"$raw"

# The bytes one micro-batch stashes in one stage, per (p, v, m): no job needed.
for p in $workers_list; do
  for m in $micro_batches_list; do
    for v in 1 2; do
      "$bench" --impl stash --batch "$batch" --layers "$layers" --activation "$activation" --workers "$p" --stages-per-worker "$v" --micro-batches "$m" >>"$raw"
    done
  done
done

# One run: $1 contender, $2 p, $3 m, $4 round. Appends its raw line.
run_one() {
  local contender=$1 p=$2 m=$3 round=$4 line trace=$work/trace.json log=$work/run.log status=0
  local args=(--batch "$batch" --layers "$layers" --activation "$activation" --micro-batches "$m" --warmup "$warmup" --steps "$steps")
  rm -f "$trace"
  case $contender in
    local | local-mb)
      SHOAL_NUM_THREADS=1 timeout "$run_timeout" "$bench" --impl "$contender" "${args[@]}" >"$log" 2>&1 || status=$? ;;
    hand)
      SHOAL_NUM_THREADS=1 timeout "$run_timeout" "$shoal" run -n "$p" --no-tag-output \
        "$bench" --impl hand "${args[@]}" >"$log" 2>&1 || status=$? ;;
    *)
      SHOAL_TIMELINE=$trace SHOAL_NUM_THREADS=1 timeout "$run_timeout" "$shoal" run -n "$p" --no-tag-output \
        "$bench" --impl shoal --schedule "$contender" "${args[@]}" >"$log" 2>&1 || status=$? ;;
  esac
  line=$(grep -m1 '^pipeline ' "$log" || true)
  if [[ $status != 0 || -z $line ]]; then
    echo "# $contender p=$p m=$m round $round failed (exit $status):" | tee -a "$raw"
    tail -5 "$log" | sed 's/^/#   /' | tee -a "$raw"
    return 0
  fi
  line="round=$round contender=$contender p=$p m=$m ${line#pipeline }"
  if [[ $contender != local* && $contender != hand ]]; then
    local t v costs
    t=$(python3 "$trace_py" trace "$trace" --warmup "$warmup")
    v=$([[ $contender == interleaved ]] && echo 2 || echo 1)
    # simulate() at unit costs, and at the trace's median F, B, I, W.
    costs=$(echo "$t" | sed -E 's/.*f_ms=([^ ]+) b_ms=([^ ]+) i_ms=([^ ]+) w_ms=([^ ]+).*/\1,\2,\3,\4/')
    local unit measured
    unit=$("$bench" --impl theory --schedule "$contender" --workers "$p" --stages-per-worker "$v" --micro-batches "$m")
    measured=$("$bench" --impl theory --schedule "$contender" --workers "$p" --stages-per-worker "$v" --micro-batches "$m" --costs "$costs")
    unit=$(echo "$unit" | sed -E 's/.*bubble=([^ ]+).*peak_in_flight=([^ ]+).*/sim_unit_bubble=\1 sim_peak_in_flight=\2/')
    measured=$(echo "$measured" | sed -E 's/.*bubble=([^ ]+).*/sim_measured_bubble=\1/')
    # The same lists at each stage's own median costs (stages differ: the first has no input
    # gradient to compute, the last carries the loss), transfers taking no time.
    local staged
    "$bench" --impl theory --schedule "$contender" --workers "$p" --stages-per-worker "$v" --micro-batches "$m" --describe >"$work/lists.txt"
    staged=$(python3 "$trace_py" replay "$trace" "$work/lists.txt" --warmup "$warmup" | sed -E 's/.*replay_bubble=([^ ]+).*/sim_stage_bubble=\1/')
    line="$line $t $unit $measured $staged"
  fi
  echo "$line" | tee -a "$raw"
}

n=${#contenders[@]}
for ((round = 0; round < rounds; round++)); do
  echo "# round $round: load before $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$raw"
  for p in $workers_list; do
    for m in $micro_batches_list; do
      for ((i = 0; i < n; i++)); do
        contender=${contenders[(round + i) % n]}
        # One process does not depend on p: measured beside the first p only.
        [[ $contender == local* && $p != "${workers_list%% *}" ]] && continue
        run_one "$contender" "$p" "$m" "$round"
      done
    done
  done
  echo "# round $round done: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$raw"
done

echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$raw"
echo
echo "## results (medians over rounds)"
grep -q '^round=' "$raw" || { echo "no run succeeded" >&2; exit 1; }
python3 "$trace_py" summarize "$raw"

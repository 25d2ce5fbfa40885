#!/usr/bin/env bash
# Data-parallel training throughput, shoal beside PyTorch (issue "Data-parallel training in two
# lines"): the same model and batch trained by
#   shoal    shoal::DataParallel (bench/ddp.cpp --impl shoal),
#   pytorch  PyTorch 1.13's DistributedDataParallel with gloo, from Debian's python3-torch (bench/ddp.py),
#            with its defaults; pytorch-view with gradient_as_bucket_view=True (as shoal's default),
#   hand     a hand-written LibTorch loop: one c10d all-reduce per gradient after backward (--impl hand),
#   python   shoal's Python DataParallel over the same models written in PyTorch (bench/ddp_python.py
#            --impl shoal, one block), so that its margin over PyTorch's DDP is measured in the same
#            rounds and the same way as C++ shoal's; python-local, the same program's `local` (no
#            averaging), tells the interpreter's own cost from shoal's,
# for an MLP 784-2048-2048-10 and the demo CNN, 2 workers with one intra-op thread each, batch 64
# per worker: first on loopback, then between two network namespaces joined by a veth pair shaped
# to 1 Gbit/s with tc tbf (as bench/allreduce.sh builds it; needs root, skipped otherwise).
# Contenders take turns within each round, in an order that rotates from round to round, so that
# noise from the rest of the machine falls on all alike; the table shows medians over rounds.
#
#   bench/ddp.sh [BUILD_DIR]      (default: build; needs its targets shoal_cli and ddp)
#
# Environment:
#   ROUNDS=5 SHAPED_ROUNDS=5   rounds on loopback / on the shaped link
#   MLP_STEPS=10 CNN_STEPS=60 WARMUP=3   timed and untimed steps per run
#   MODELS="mlp cnn" LINKS="loopback shaped"
#   CONTENDERS="shoal pytorch pytorch-view hand"; may add "local" (each worker trains alone: no
#   averaging, the bound for all), "lockstep" (no averaging, but a barrier after every backward:
#   the bound for synchronous averaging, which waits for the slowest worker), shoal's variants
#   (shoal-*, listed in variant_flags below) and PyTorch's (pytorch-*, in pytorch_flags), e.g. to
#   compare the 16-bit hooks with each other:
#   CONTENDERS="shoal pytorch pytorch-view hand shoal-fp16 pytorch-fp16 pytorch-view-fp16".
#   RAW=FILE                   where the raw result lines go (default: bench/results/ddp-DATE.txt,
#                              kept in the repository beside RESULTS.md)
#   RUN_TIMEOUT=300            seconds allowed to one run (every process is under `timeout`)
#
# Where separate runs differ by more than the gap being measured (the CNN beside `local`), bench/ddp
# alone compares shoal's own contenders in one job, taking turns in blocks of B steps, and prints
# their ratios itself (bench/ddp.cpp, --alternate), under the same malloc tunables:
#   source bench/malloc_tunables.sh
#   build/bin/shoal run -n 2 --no-tag-output build/bench/ddp --model cnn \
#     --impl local,lockstep,shoal --alternate 10 --steps 1000 --warmup 20
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
shoal=$(realpath "$build/bin/shoal")
bench=$(realpath "$build/bench/ddp")
python=/usr/bin/python3  # Debian's python3-torch; the python3 on PATH may have no torch
ddp_py=$here/ddp.py
rounds=${ROUNDS:-5}
shaped_rounds=${SHAPED_ROUNDS:-5}
warmup=${WARMUP:-3}
models=${MODELS:-mlp cnn}
links=${LINKS:-loopback shaped}
read -r -a contenders <<<"${CONTENDERS:-shoal pytorch pytorch-view hand}"
run_timeout=${RUN_TIMEOUT:-300}

for tool in "$shoal" "$bench"; do
  [[ -x "$tool" ]] || { echo "ddp.sh: $tool is missing; build the targets shoal_cli and ddp" >&2; exit 2; }
done
"$python" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null ||
  { echo "ddp.sh: $python has no torch.distributed with gloo; install python3-torch" >&2; exit 2; }

steps_for() { [[ $1 == mlp ]] && echo "${MLP_STEPS:-10}" || echo "${CNN_STEPS:-60}"; }

# Variants of shoal's DataParallel, for what-if runs beside the defaults.
variant_flags() {
  case $1 in
    shoal-fp16) echo "--fp16" ;;                  # dp::fp16_compress_hook()
    shoal-bf16) echo "--bf16" ;;                  # dp::bf16_compress_hook()
    shoal-copy) echo "--no-bucket-view" ;;        # gradient_as_bucket_view = false
    shoal-unweighted) echo "--no-weigh" ;;        # weigh_by_batch_share = false: no share hooks
    shoal-noise) echo "--noise" ;;                # measure_gradient_noise = true
    shoal-t1) echo "--gloo-threads 1" ;;
    shoal-t4) echo "--gloo-threads 4" ;;
    shoal-tcp) echo "" ;;                         # SHOAL_COMM=tcp (variant_env): Gloo's TCP path
    shoal-spins*) echo "" ;;                      # SHOAL_SHM_SPINS=N (variant_env), e.g. shoal-spins50
    *) echo "ddp.sh: unknown contender $1" >&2; return 2 ;;
  esac
}

# The environment of a shoal contender: shoal-tcp forces Gloo's TCP path between co-located
# workers (docs/comm.md, "Shared memory among co-located workers"), shoal-spinsN sets how long a
# shared-memory wait spins before it sleeps (Note [Spinning]); the others take the defaults.
variant_env() {
  case $1 in
    shoal-tcp) echo "SHOAL_COMM=tcp" ;;
    shoal-spins*) echo "SHOAL_COMM=auto SHOAL_SHM_SPINS=${1#shoal-spins}" ;;
    python*) echo "SHOAL_COMM=auto PYTHONPATH=$(realpath "$build")/python" ;;
    *) echo "SHOAL_COMM=auto" ;;
  esac
}

# PyTorch's configurations: its defaults, and what a user tuning DDP would set.
pytorch_flags() {
  case $1 in
    pytorch) echo "" ;;
    pytorch-view) echo "--bucket-view" ;;                # gradient_as_bucket_view=True
    pytorch-fp16) echo "--fp16" ;;                       # PyTorch's fp16_compress_hook
    pytorch-view-fp16) echo "--bucket-view --fp16" ;;
    *) echo "ddp.sh: unknown contender $1" >&2; return 2 ;;
  esac
}

for contender in "${contenders[@]}"; do
  case $contender in
    shoal | hand | local | lockstep | python | python-local) ;;
    shoal-*) variant_flags "$contender" >/dev/null || exit 2 ;;
    pytorch*) pytorch_flags "$contender" >/dev/null || exit 2 ;;
    *) echo "ddp.sh: unknown contender $contender" >&2; exit 2 ;;
  esac
done

# Every contender runs with the malloc tunables that keep the heap (bench/malloc_tunables.sh says
# why); GLIBC_TUNABLES set by the caller wins.
source "$here/malloc_tunables.sh"

results=$(mktemp -d /tmp/shoal-ddp.XXXXXX)
mkdir -p "$here/results"
raw=${RAW:-$here/results/ddp-$(date -u +%Y%m%dT%H%M%SZ).txt}
echo "## machine"
echo "date: $(date -u)"
echo "cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
echo "os: $(. /etc/os-release && echo "$PRETTY_NAME"); torch $("$python" -c 'import torch; print(torch.__version__)')"
echo "scheduling: $(chrt -p $$ | sed -n 1p | sed 's/.*: //'), $(cat /proc/self/autogroup 2>/dev/null || echo "no autogroup")"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "GLIBC_TUNABLES=$GLIBC_TUNABLES"
echo "logs: $results; raw lines: $raw"
{
  echo "# bench/ddp.sh raw lines: one per run (round, link, contender, then the worker's line)"
  echo "# date: $(date -u); cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg); GLIBC_TUNABLES=$GLIBC_TUNABLES"
  echo "# ROUNDS=$rounds SHAPED_ROUNDS=$shaped_rounds WARMUP=$warmup MLP_STEPS=${MLP_STEPS:-10} CNN_STEPS=${CNN_STEPS:-60} MODELS=\"$models\" LINKS=\"$links\" CONTENDERS=\"${contenders[*]}\""
} >"$raw"

# One run of one contender. $1: link, $2: model, $3: contender, $4: round; prints its ddp line.
# run_pair (below) starts the two workers for the link.
port=29650
run_one() {
  local link=$1 model=$2 contender=$3 round=$4 line status=0
  local steps
  steps=$(steps_for "$model")
  port=$((port + 1))  # a fresh port per run: no wait for the last run's sockets to close
  local log=$results/$link-$model-$contender-$round.log
  run_pair "$link" "$model" "$contender" "$steps" >"$log" 2>&1 || status=$?
  line=$(grep -m1 '^ddp ' "$log" || true)
  if [[ $status != 0 || -z $line ]]; then
    echo "# $link $model $contender round $round failed (exit $status); last lines of $log:" | tee -a "$raw"
    tail -5 "$log" | sed 's/^/#   /'
    return 0
  fi
  echo "round=$round link=$link contender=$contender $line" | tee -a "$raw"
}

# Command line of a contender's worker ($1 model, $2 contender, $3 steps), after the launcher.
shoal_args() {
  local model=$1 contender=$2 steps=$3 impl flags=""
  if [[ $contender == python* ]]; then
    [[ $contender == python ]] && impl=shoal || impl=local
    echo "$python $here/ddp_python.py --impl $impl --model $model --warmup $warmup --steps $steps --alternate $steps"
    return
  fi
  case $contender in
    shoal) impl=shoal ;;
    hand) impl=hand ;;
    local) impl=local ;;
    lockstep) impl=lockstep ;;
    shoal-*) impl=shoal; flags=$(variant_flags "$contender") ;;
  esac
  echo "$bench --impl $impl --model $model --warmup $warmup --steps $steps $flags"
}

# bench/ddp.py's arguments for a PyTorch contender ($1 model, $2 contender, $3 steps).
pytorch_args() {
  echo "--model $1 --warmup $warmup --steps $3 $(pytorch_flags "$2")"
}

run_pair() {
  local link=$1 model=$2 contender=$3 steps=$4 status=0
  if [[ $link == loopback ]]; then
    if [[ $contender == pytorch* ]]; then
      local pids=()
      for rank in 1 0; do
        # shellcheck disable=SC2046
        RANK=$rank WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port GLOO_SOCKET_IFNAME=lo \
          timeout "$run_timeout" "$python" "$ddp_py" $(pytorch_args "$model" "$contender" "$steps") &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
    else
      # shellcheck disable=SC2046
      env $(variant_env "$contender") SHOAL_NUM_THREADS=1 timeout "$run_timeout" "$shoal" run -n 2 \
        --no-tag-output $(shoal_args "$model" "$contender" "$steps") || status=$?
    fi
    return "$status"
  fi
  # Shaped link: one worker per namespace. Node 1 (namespace b) prints nothing but errors.
  if [[ $contender == pytorch* ]]; then
    # shellcheck disable=SC2046
    ip netns exec "$ns_b" env RANK=1 WORLD_SIZE=2 MASTER_ADDR=$addr_a MASTER_PORT=$port GLOO_SOCKET_IFNAME=${veth}b \
      timeout "$run_timeout" "$python" "$ddp_py" $(pytorch_args "$model" "$contender" "$steps") &
    bg_pid=$!
    # shellcheck disable=SC2046
    ip netns exec "$ns_a" env RANK=0 WORLD_SIZE=2 MASTER_ADDR=$addr_a MASTER_PORT=$port GLOO_SOCKET_IFNAME=${veth}a \
      timeout "$run_timeout" "$python" "$ddp_py" $(pytorch_args "$model" "$contender" "$steps") || status=$?
  else
    # shellcheck disable=SC2046
    ip netns exec "$ns_b" env SHOAL_NUM_THREADS=1 timeout "$run_timeout" "$shoal" run --nnodes 2 --node-rank 1 \
      --master "$addr_a:$port" -n 1 --no-tag-output $(shoal_args "$model" "$contender" "$steps") &
    bg_pid=$!
    # shellcheck disable=SC2046
    ip netns exec "$ns_a" env SHOAL_NUM_THREADS=1 timeout "$run_timeout" "$shoal" run --nnodes 2 --node-rank 0 \
      --master "$addr_a:$port" -n 1 --no-tag-output $(shoal_args "$model" "$contender" "$steps") || status=$?
  fi
  wait "$bg_pid" || status=$?
  bg_pid=
  return "$status"
}

# Rounds of every contender on every model; the order of contenders rotates each round.
run_rounds() {
  local link=$1 count=$2 n=${#contenders[@]}
  for ((round = 0; round < count; round++)); do
    for model in $models; do
      for ((i = 0; i < n; i++)); do
        run_one "$link" "$model" "${contenders[(round + i) % n]}" "$round"
      done
    done
    echo "# $link round $round done; load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$raw"
  done
}

ns_a=shoal-ddp-a-$$
ns_b=shoal-ddp-b-$$
veth=sdv$$  # interface names have at most 15 characters
addr_a=10.78.0.1
addr_b=10.78.0.2
netns_made=0
bg_pid=  # node 1's launcher while a shaped run is under way
cleanup() {
  if [[ -n $bg_pid ]]; then kill "$bg_pid" 2>/dev/null || true; fi
  # Deleting a namespace also deletes its end of the veth pair, and with it the pair.
  if [[ $netns_made == 1 ]]; then
    ip netns del "$ns_a" 2>/dev/null || true
    ip netns del "$ns_b" 2>/dev/null || true
  fi
}
trap cleanup EXIT

for link in $links; do
  echo
  if [[ $link == loopback ]]; then
    echo "## loopback, 2 workers, $rounds rounds"
    run_rounds loopback "$rounds"
    continue
  fi
  echo "## shaped link: 2 network namespaces, veth pair, tbf rate 1gbit burst 64kb latency 50ms on both ends, $shaped_rounds rounds"
  if [[ $(id -u) != 0 ]]; then
    echo "skipped: creating network namespaces and shaping a link needs root (ip netns, tc)"
    continue
  fi
  if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
    echo "skipped: ip or tc (iproute2) is not installed"
    continue
  fi
  netns_made=1
  ip netns add "$ns_a"
  ip netns add "$ns_b"
  ip link add "${veth}a" netns "$ns_a" type veth peer name "${veth}b" netns "$ns_b"
  ip -n "$ns_a" addr add "$addr_a/24" dev "${veth}a"
  ip -n "$ns_b" addr add "$addr_b/24" dev "${veth}b"
  for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
  ip -n "$ns_a" link set "${veth}a" up
  ip -n "$ns_b" link set "${veth}b" up
  # Both directions: a 2-worker ring all-reduce sends both ways at once.
  ip netns exec "$ns_a" tc qdisc add dev "${veth}a" root tbf rate 1gbit burst 64kb latency 50ms
  ip netns exec "$ns_b" tc qdisc add dev "${veth}b" root tbf rate 1gbit burst 64kb latency 50ms
  run_rounds shaped "$shaped_rounds"
  ip netns exec "$ns_a" tc -s qdisc show dev "${veth}a" | sed 's/^/# tbf node 0: /'
done

echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "## results (medians over rounds)"
grep -q '^round=' "$raw" || { echo "no run succeeded; see the logs in $results" >&2; exit 1; }
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | sed 's/^/# /' >>"$raw"
"$python" "$ddp_py" summarize "$raw"

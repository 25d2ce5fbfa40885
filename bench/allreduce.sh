#!/usr/bin/env bash
# All-reduce bus bandwidth, shoal beside raw c10d ProcessGroupGloo (bench/allreduce.cpp):
#   1. 2 and 4 workers on loopback;
#   2. two "hosts": network namespaces joined by a veth pair shaped to 1 Gbit/s with tc tbf, one
#      `shoal run` per namespace, with 1 and then 2 workers each (SHAPED_PER_HOST, default "1 2"),
#      beside the link's bound. Needs root; skipped if not.
#
#   bench/allreduce.sh [BUILD_DIR]      (default: build; e.g. build-bench)
# Environment: REPS (repetitions per size, default 15 on loopback), SHAPED_REPS (default 7),
# LOOPBACK_WORKERS (default "2 4"; empty: no loopback runs), SHAPED_PER_HOST (default "1 2"),
# SHAPED (default 1; 0 leaves the veth pair unshaped),
# FACTOR (size step, default 2), SLICED=1 adds the "raw gloo waited in 250 ms slices" column,
# RAW=FILE where every repetition's times go (default bench/results/allreduce-DATE.txt, kept in
# the repository beside RESULTS.md; the tables are medians of these lines).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
shoal=$(realpath "$build/bin/shoal")
bench=$(realpath "$build/bench/allreduce")
reps=${REPS:-15}
shaped_reps=${SHAPED_REPS:-7}
factor=${FACTOR:-2}
sliced=()
[[ "${SLICED:-0}" == 1 ]] && sliced=(--sliced)

mkdir -p "$here/results"
raw=$(realpath -m "${RAW:-$here/results/allreduce-$(date -u +%Y%m%dT%H%M%SZ).txt}")
echo "# bench/allreduce.sh raw lines; date: $(date -u); cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg)" >"$raw"
echo "# REPS=$reps SHAPED_REPS=$shaped_reps FACTOR=$factor SLICED=${SLICED:-0}" >>"$raw"

for tool in "$shoal" "$bench"; do
  [[ -x "$tool" ]] || { echo "allreduce.sh: $tool is missing; build the targets shoal_cli and allreduce" >&2; exit 2; }
done

echo "## machine"
echo "date: $(date)"
echo "cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
echo "os: $(. /etc/os-release && echo "$PRETTY_NAME")"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "raw lines: $raw"

for n in ${LOOPBACK_WORKERS-2 4}; do
  echo
  echo "## loopback, $n workers"
  echo "# link=loopback workers=$n" >>"$raw"
  timeout 600 "$shoal" run -n "$n" --no-tag-output "$bench" --reps "$reps" --factor "$factor" "${sliced[@]}" \
    --raw "$raw"
  echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
done

echo
shaped=${SHAPED:-1}  # 0: the veth pair as it is (no tbf), to see where a fast link moves the crossover
if [[ $shaped == 1 ]]; then
  echo "## shaped link: 2 network namespaces, veth pair, tbf rate 1gbit burst 64kb latency 50ms"
else
  echo "## unshaped link: 2 network namespaces, veth pair without tbf (bound column: as if 1 Gbit/s)"
fi
if [[ $(id -u) != 0 ]]; then
  echo "skipped: creating network namespaces and shaping a link needs root (ip netns, tc)"
  exit 0
fi
for tool in ip tc; do
  command -v "$tool" >/dev/null || { echo "skipped: $tool (iproute2) is not installed"; exit 0; }
done

# Unique names, so that concurrent runs (or a test) never touch each other's namespaces; the
# addresses exist only inside these namespaces.
ns_a=shoal-bench-a-$$
ns_b=shoal-bench-b-$$
veth=sbv$$  # interface names have at most 15 characters
addr_a=10.77.0.1
addr_b=10.77.0.2
port=29500

node1_pid=
cleanup() {
  [[ -n "$node1_pid" ]] && kill "$node1_pid" 2>/dev/null || true
  # Deleting a namespace deletes its end of the veth pair, and with it the pair.
  ip netns del "$ns_a" 2>/dev/null || true
  ip netns del "$ns_b" 2>/dev/null || true
}
trap cleanup EXIT

ip netns add "$ns_a"
ip netns add "$ns_b"
ip link add "${veth}a" netns "$ns_a" type veth peer name "${veth}b" netns "$ns_b"
ip -n "$ns_a" addr add "$addr_a/24" dev "${veth}a"
ip -n "$ns_b" addr add "$addr_b/24" dev "${veth}b"
for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
ip -n "$ns_a" link set "${veth}a" up
ip -n "$ns_b" link set "${veth}b" up
# Both directions: an all-reduce ring sends both ways at once.
if [[ $shaped == 1 ]]; then
  ip netns exec "$ns_a" tc qdisc add dev "${veth}a" root tbf rate 1gbit burst 64kb latency 50ms
  ip netns exec "$ns_b" tc qdisc add dev "${veth}b" root tbf rate 1gbit burst 64kb latency 50ms
fi
ip netns exec "$ns_a" tc qdisc show dev "${veth}a"

# One worker per host: shoal's path is Gloo, as raw gloo's. Two per host: shoal's all-reduce is
# hierarchical (shared memory inside each host, Gloo between them), raw gloo a flat ring over all
# four; the bound is what any all-reduce between two hosts must send over the link.
status=0
for per_host in ${SHAPED_PER_HOST:-1 2}; do
  echo
  echo "### $per_host worker(s) per host"
  echo "# link=$([[ $shaped == 1 ]] && echo shaped || echo veth) workers=$((2 * per_host)) hosts=2 bound_gbit=1" >>"$raw"
  args=(--reps "$shaped_reps" --factor "$factor" --bound-gbit 1 --hosts 2 "${sliced[@]}" --raw "$raw")
  # Node 1 prints nothing but errors (only rank 0 prints the table).
  ip netns exec "$ns_b" timeout 600 "$shoal" run --nnodes 2 --node-rank 1 --master "$addr_a:$port" \
    -n "$per_host" --no-tag-output "$bench" "${args[@]}" &
  node1_pid=$!
  ip netns exec "$ns_a" timeout 600 "$shoal" run --nnodes 2 --node-rank 0 --master "$addr_a:$port" \
    -n "$per_host" --no-tag-output "$bench" "${args[@]}" || status=$?
  wait "$node1_pid" || status=$?
  node1_pid=
  echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
  port=$((port + 1))
done
ip netns exec "$ns_a" tc -s qdisc show dev "${veth}a" | sed 's/^/# /'
exit "$status"

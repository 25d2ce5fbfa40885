#!/bin/bash
# A model whose replicated Adam state does not fit a worker's memory trains under ZeRO stage 3
# (docs/memory.md, "Benchmark"): bench/memory's GPT on N workers, each worker in a memory cgroup
# (cgroup v1, /sys/fs/cgroup/memory; root) capped at LIMIT MiB with no swap, first replicated
# (zero_stage 0), then at stage 3, the same model, batch and steps. A worker over its cap is
# killed by the kernel (SIGKILL), as on a cluster that enforces a memory limit. Prints each
# worker's peak charge (memory.max_usage_in_bytes) and how each run ended. The raw lines go to
# RAW (default bench/results/memory_cap-<UTC time>.txt).
#
#   bash bench/memory_cap.sh [build] [limit MiB] [workers] [bench/memory arguments...]
#   defaults: build 300 4 --width 512 --layers 6 --batch 1 --seq 16 --steps 3 --block 3 --bucket-mb 1
set -uo pipefail

memory_root=/sys/fs/cgroup/memory

# Inside one worker (run by shoal run): join a cgroup of its own, capped, run the program, report.
if [ "${1:-}" = --inside ]; then
  limit_mb=$2
  shift 2
  name="shoal-bench-cap-${SHOAL_JOB_ID:-$PPID}-${SHOAL_RANK:-0}"
  cgroup="$memory_root/$name"
  home=$(awk -F: '$2 == "memory" { print $3 }' /proc/self/cgroup)
  mkdir -p "$cgroup"
  echo $((limit_mb * 1024 * 1024)) > "$cgroup/memory.limit_in_bytes"
  [ -e "$cgroup/memory.memsw.limit_in_bytes" ] &&
    echo $((limit_mb * 1024 * 1024)) > "$cgroup/memory.memsw.limit_in_bytes"
  echo $$ > "$cgroup/cgroup.procs"
  "$@"
  status=$?
  peak=$(cat "$cgroup/memory.max_usage_in_bytes")
  kills=$(awk '$1 == "oom_kill" { print $2 }' "$cgroup/memory.oom_control")
  echo $$ > "$memory_root$home/cgroup.procs"
  rmdir "$cgroup" 2>/dev/null
  echo "cap worker=${SHOAL_RANK:-0} limit_mb=$limit_mb peak_mb=$(awk -v b="$peak" 'BEGIN { printf "%.1f", b / 1048576 }') oom_kills=${kills:-0} exit=$status"
  exit $status
fi

build=${1:-build}
limit=${2:-300}
workers=${3:-4}
shift $(($# < 3 ? $# : 3))
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--width 512 --layers 6 --batch 1 --seq 16 --steps 3 --block 3 --bucket-mb 1)
if [ ! -w "$memory_root" ]; then
  echo "memory_cap.sh: $memory_root is not writable; expected cgroup v1's memory controller and root" >&2
  exit 2
fi
out=${RAW:-bench/results/memory_cap-$(date -u +%Y%m%dT%H%MZ).txt}
: > "$out"
script=$(realpath "$0")
for stage in 0 3; do
  echo "== zero_stage $stage, $workers workers, $limit MiB each" | tee -a "$out"
  SHOAL_COMM=tcp GLIBC_TUNABLES=${GLIBC_TUNABLES-glibc.malloc.mmap_threshold=131072:glibc.malloc.trim_threshold=131072} \
    "$build/bin/shoal" run -n "$workers" --no-tag-output \
    bash "$script" --inside "$limit" "$build/bench/memory" --stages "$stage" "${args[@]}" 2>&1 |
    grep -E '^(memory |cap |shoal run)' | tee -a "$out"
  echo "run exit ${PIPESTATUS[0]}" | tee -a "$out"
  # A worker that shoal run stopped (after another was killed) leaves its empty cgroup behind.
  for left in "$memory_root"/shoal-bench-cap-*; do [ -d "$left" ] && rmdir "$left" 2>/dev/null; done
done

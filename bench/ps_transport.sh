#!/usr/bin/env bash
# The parameter server's transport candidates on loopback (bench/ps_transport.cpp): gRPC (shoal's
# service), c10d ProcessGroupGloo send/recv, a plain TCP socket and gRPC alone (echo), side by side
# in one run.
#
#   bench/ps_transport.sh [BUILD_DIR]      (default: build)
# Environment: REPS (repetitions per size, default 5), SIZES (default 4K,64K,512K,2M,8M).
#   BASELINE=BINARY  another build of ps_transport (e.g. from an earlier commit) to compare with:
#                    the two then take turns, ROUNDS times each (default 2), each table labelled.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
bench=$(realpath "$build/bench/ps_transport")
[[ -x "$bench" ]] || { echo "ps_transport.sh: $bench is missing; build the target ps_transport" >&2; exit 2; }
if [[ -n ${BASELINE:-} && ! -x $BASELINE ]]; then
  echo "ps_transport.sh: BASELINE=$BASELINE is not an executable" >&2
  exit 2
fi

echo "# bench/ps_transport.sh; date: $(date -u); cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
run() { OMP_NUM_THREADS=1 "$1" --reps "${REPS:-5}" --sizes "${SIZES:-4K,64K,512K,2M,8M}"; }
if [[ -z ${BASELINE:-} ]]; then
  run "$bench"
else
  for ((round = 0; round < ${ROUNDS:-2}; round++)); do
    echo "## round $round: baseline ($BASELINE)"
    run "$BASELINE"
    echo "## round $round: this build ($bench)"
    run "$bench"
  done
fi
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"

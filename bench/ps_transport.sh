#!/usr/bin/env bash
# The parameter server's transport candidates on loopback (bench/ps_transport.cpp): gRPC (shoal's
# service), c10d ProcessGroupGloo send/recv and a plain TCP socket, side by side in one run.
#
#   bench/ps_transport.sh [BUILD_DIR]      (default: build)
# Environment: REPS (repetitions per size, default 5), SIZES (default 4K,64K,512K,2M,8M).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=${1:-$here/../build}
bench=$(realpath "$build/bench/ps_transport")
[[ -x "$bench" ]] || { echo "ps_transport.sh: $bench is missing; build the target ps_transport" >&2; exit 2; }

echo "# bench/ps_transport.sh; date: $(date -u); cores: $(nproc); load before: $(cut -d' ' -f1-3 /proc/loadavg)"
OMP_NUM_THREADS=1 "$bench" --reps "${REPS:-5}" --sizes "${SIZES:-4K,64K,512K,2M,8M}"
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"

#!/usr/bin/env bash
# Installs everything shoal's build, tests, demo and benchmarks use, from Debian's archive.
# Idempotent; prints nothing when all is there.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev           # LibTorch 1.13 and c10d's Gloo backend
  libopenblas0-openmp                # an optimized BLAS: without it LibTorch runs on the reference
                                     # BLAS, ~25x slower; the OpenMP build obeys torch's thread count
  libgtest-dev libcli11-dev nlohmann-json3-dev libspdlog-dev zlib1g-dev
  dataset-fashion-mnist              # the demo's data
  iproute2                           # network namespaces and tc for multi-host tests
  procps                             # pgrep/ps in tests
  libssl-dev                         # OpenSSL libcrypto: HMAC-SHA256 on gossip datagrams
  etcd-server                        # a real etcd (3.4) for the etcd rendezvous tests
  python3-torch                      # shoal's Python package binds it (docs/python.md); torchrun, for
                                     # the test that torch.distributed programs run unchanged under
                                     # shoal run; PyTorch's DDP for benchmarks
  python3-dev pybind11-dev python3-pytest  # the Python extension's build, and its tests
  munge slurmctld slurmd slurm-client  # a real Slurm (22.05) that the Slurm tests start
  openmpi-bin                        # a real mpirun for the Open MPI tests
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler  # the parameter server's gRPC service
  libsqlite3-dev libcpp-httplib-dev  # the job queue's state (SQLite) and its REST API (HTTP)
  chromium                           # headless, for the test of the job queue's dashboard
  python3-pandas python3-scipy       # Pollux's cluster simulator, which bench/pollux.py drives
)

missing=()
for package in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$package" 2>/dev/null || true)
  [ "$status" = "install ok installed" ] || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "setup: installing ${missing[*]}" >&2
run_as_root=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  run_as_root=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${run_as_root[@]}" apt-get update -qq
"${run_as_root[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null

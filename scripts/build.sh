#!/usr/bin/env bash
# Configures and builds shoal in build/ (Release, Ninja). Extra arguments go to the build step,
# e.g. `scripts/build.sh --target fashion_mnist`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(nproc)" "$@"

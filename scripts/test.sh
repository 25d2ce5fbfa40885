#!/usr/bin/env bash
# The README's second command: set up, build, and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
cd build
exec ctest --output-on-failure -j 2 "$@"

#!/usr/bin/env bash
# The README's first command: set up, build, and train on Fashion-MNIST with two workers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh --target shoal_cli fashion_mnist
exec build/bin/shoal run -n 2 build/examples/fashion_mnist "$@"

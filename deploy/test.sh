#!/usr/bin/env bash
# Installs what is missing, builds with -Werror (CI preset) and runs every test: unit,
# integration, and the benchmarks in smoke mode. This is the README's test command and what
# .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
cmake --preset ci
cmake --build --preset ci
ctest --preset ci -j "$(nproc)"

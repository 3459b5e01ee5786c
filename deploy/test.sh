#!/usr/bin/env bash
# The README's test command: installs what is missing, builds the release tree (the one
# deploy/run.sh builds: -Werror, so a tree run.sh left behind is reused as it is) and runs every
# test in it: unit, integration, the deployment checks, and the benchmarks in smoke mode.
# .ci/run calls this first, then builds and tests the ci-clang tree (sanitizers, lock
# annotations, fuzzers).
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
cmake --preset release
cmake --build --preset release
ctest --preset release -j "$(nproc)"

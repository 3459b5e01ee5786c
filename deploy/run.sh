#!/usr/bin/env bash
# Installs what is missing, builds the release preset and runs the main job: the core
# bookkeeping benchmark, each figure beside a bare-vector baseline from the same run.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
cmake --preset release
cmake --build --preset release
build/release/bench/core_bench --benchmark_repetitions=3 --benchmark_min_time=0.2 "$@"

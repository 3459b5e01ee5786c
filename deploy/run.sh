#!/usr/bin/env bash
# Installs what is missing, builds the release preset and runs the main job: a Mooncake trace
# replayed through the prefix cache (when ../shared is beside the checkout), then the core
# bookkeeping benchmark, each figure beside a bare-vector baseline from the same run.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
cmake --preset release
cmake --build --preset release
trace=../shared/traces/mooncake/conversation_trace.jsonl
if [[ -f "$trace" ]]; then
  build/release/tools/kvpool-replay --trace="$trace" --block_size=512 --capacity_blocks=1000
else
  echo "run.sh: $trace is absent; skipping the trace replay"
fi
build/release/bench/core_bench --benchmark_repetitions=3 --benchmark_min_time=0.2 "$@"

#!/usr/bin/env bash
# Installs what is missing, builds with -Werror (CI preset) and runs every test: unit,
# integration, and the benchmarks in smoke mode; then builds the libraries with clang's
# -Wthread-safety -Werror (clang-tsa preset), which checks every lock annotation. This is the
# README's test command and what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh
cmake --preset ci
cmake --build --preset ci
ctest --preset ci -j "$(nproc)"
cmake --preset clang-tsa
cmake --build --preset clang-tsa

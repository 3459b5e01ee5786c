#!/usr/bin/env bash
# The house format (.clang-format: Google style at 100 columns) on every C++ and CUDA source the
# repository tracks: `clang-format --dry-run -Werror`, Debian 12's clang-format (14). .ci/run runs
# it before building anything; it prints each file and line that differs. To fix a change:
#   git diff --name-only -- '*.cc' '*.h' '*.cu' '*.cuh' '*.inc' | xargs clang-format -i
set -euo pipefail
cd "$(dirname "$0")/../.."
mapfile -t files < <(git ls-files -- '*.cc' '*.h' '*.cu' '*.cuh' '*.inc')
clang-format --dry-run -Werror "${files[@]}"
echo "format: ${#files[@]} files as .clang-format writes them"

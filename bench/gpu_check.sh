#!/usr/bin/env bash
# The CUDA backend on a machine with a GPU, from a fresh build: the kernel parity tests (decode
# and block ops, then prefill; every KV dtype, fp8 e4m3 and int8 included, asymmetric K/V pairs,
# and the CUDA WriteKv's quantized blocks byte-compared with the CPU's), the model on the GPU
# against the dense reference and the host model (8-bit and mixed layouts too), then the decode
# bandwidth benchmark, then the Python client's CUDA mapping. Everything finishes within 8
# minutes (each step has its own timeout, cut to what is left of the budget).
#
#   bench/gpu_check.sh            # from anywhere; builds in <repo>/build/gpu
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly BUDGET_S=480
readonly BUILD_DIR=build/gpu
readonly START_S=${SECONDS}

# Seconds left of the budget, at most $1; fails (ending the script) when under 10 s are left.
left() {
  local remaining=$((BUDGET_S - (SECONDS - START_S)))
  if ((remaining < 10)); then
    echo "gpu_check: out of time" >&2
    return 1
  fi
  echo $((remaining < $1 ? remaining : $1))
}

step() { echo; echo "=== $* ($((SECONDS - START_S)) s)"; }

step "devices"
nvidia-smi -L

step "configure ${BUILD_DIR}"
rm -rf "${BUILD_DIR}"
t=$(left 120)
timeout "${t}" cmake -S . -B "${BUILD_DIR}" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DKVPOOL_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90

# The backend-parameterised tests run their CUDA cases only (the CPU's run in every ctest), and
# KVPOOL_REQUIRE_GPU=1 turns a CUDA case that would skip (no device seen) into a failure.
readonly GPU_TESTS="device_parity_test decode_parity_test prefill_parity_test backend_model_test"
step "build ${GPU_TESTS} cuda_decode_bench"
t=$(left 300)
# shellcheck disable=SC2086  # one target per word
timeout "${t}" cmake --build "${BUILD_DIR}" --target ${GPU_TESTS} cuda_decode_bench -j "$(nproc)"

for test in ${GPU_TESTS}; do
  step "${test} (CUDA cases)"
  t=$(left 120)
  binary=$(find "${BUILD_DIR}/tests" -type f -name "${test}" | head -n 1)
  KVPOOL_REQUIRE_GPU=1 timeout "${t}" "${binary}" --gtest_filter='*cuda*'
done

step "cuda_decode_bench"
t=$(left 120)
timeout "${t}" "${BUILD_DIR}/bench/cuda/cuda_decode_bench"

# The Python client's CUDA mapping (kvpool.cuda, the driver API by ctypes): two Python processes
# share KV through a kvpoold pool on the GPU. Needs the Debian Python packages of
# deploy/install-deps.sh; without them the step says so and the check goes on.
step "python CUDA mapping (tests/client/python/test_cuda_mapping.py)"
if /usr/bin/python3 -c "import grpc, google.protobuf, aiohttp, numpy, sentencepiece" 2>/dev/null; then
  t=$(left 150)
  timeout "${t}" cmake --build "${BUILD_DIR}" --target kvpoold kvpool_python -j "$(nproc)"
  t=$(left 60)
  (cd tests/client/python &&
    KVPOOLD="../../../${BUILD_DIR}/daemon/kvpoold" KVPOOL_REQUIRE_GPU=1 PYTHONDONTWRITEBYTECODE=1 \
    PYTHONPATH="../../../client/python:../../../${BUILD_DIR}/python:." \
    timeout "${t}" /usr/bin/python3 -m unittest -v test_cuda_mapping)
else
  echo "gpu_check: skipped: /usr/bin/python3 lacks the client's packages (deploy/install-deps.sh)"
fi

step "done"

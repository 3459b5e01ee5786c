#pragma once

// absl::Status from CUDA runtime errors (STYLE.md: CUDA failures are INTERNAL, out of memory is
// RESOURCE_EXHAUSTED).

#include <cuda_runtime_api.h>

#include <string_view>

#include "absl/status/status.h"

namespace kvpool::kernels::cuda {

// OK for cudaSuccess; RESOURCE_EXHAUSTED for cudaErrorMemoryAllocation; INTERNAL otherwise, with
// `what` and the runtime's name and description of the error.
absl::Status CudaStatus(cudaError_t err, std::string_view what);

}  // namespace kvpool::kernels::cuda

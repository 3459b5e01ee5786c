#include "kernels/cuda/cuda_status.h"

#include <string>

#include "fmt/format.h"

namespace kvpool::kernels::cuda {

absl::Status CudaStatus(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  std::string message =
      fmt::format("{}: {} ({})", what, cudaGetErrorString(err), cudaGetErrorName(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace kvpool::kernels::cuda

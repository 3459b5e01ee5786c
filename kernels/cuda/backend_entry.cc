// The two C symbols that make libkvpool_cuda.so a kvpool backend (kernels/backend.h). With the
// model's (model/cuda/model_entry.cc) they are the library's only exported symbols (exports.map);
// everything else, the static CUDA runtime included, stays inside it.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdio>
#include <memory>
#include <string>

#include "kernels/cuda/cuda_device.h"

#define KVPOOL_BACKEND_EXPORT extern "C" __attribute__((visibility("default")))

// The number of usable CUDA devices; 0 when there is no driver or no device (the runtime loads
// the driver itself and reports its absence as an error, which is not a failure here).
KVPOOL_BACKEND_EXPORT int kvpool_backend_device_count(void) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

// A new CudaDevice the caller owns, or null with a NUL-terminated message (truncated to
// `error_bytes`) in `error`.
KVPOOL_BACKEND_EXPORT kvpool::kernels::Device* kvpool_backend_create_device(int ordinal,
                                                                            char* error,
                                                                            size_t error_bytes) {
  absl::StatusOr<std::unique_ptr<kvpool::kernels::cuda::CudaDevice>> device =
      kvpool::kernels::cuda::CudaDevice::Create(ordinal);
  if (!device.ok()) {
    if (error != nullptr && error_bytes > 0) {
      std::snprintf(error, error_bytes, "%s", device.status().ToString().c_str());
    }
    return nullptr;
  }
  return device->release();
}

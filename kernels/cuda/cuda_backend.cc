#include "kernels/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <memory>
#include <string>

#include "kernels/cuda/cuda_device.h"

namespace kvpool::kernels::cuda {

int BackendDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

Device* BackendCreateDevice(const DeviceParams* params, BackendError* error) {
  absl::StatusOr<std::unique_ptr<CudaDevice>> device = CudaDevice::Create(params->ordinal);
  if (!device.ok()) {
    error->code = static_cast<int>(device.status().code());
    std::snprintf(error->message, sizeof(error->message), "%s",
                  std::string(device.status().message()).c_str());
    return nullptr;
  }
  return device->release();
}

}  // namespace kvpool::kernels::cuda

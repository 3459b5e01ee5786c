#pragma once

// The CUDA backend's device half of its registration (kernels/backend_api.h). The registration
// itself, with the model's factory, is model/cuda/backend_init.cc: the one exported symbol of
// libkvpool_cuda.so.

#include "kernels/backend_api.h"

namespace kvpool::kernels::cuda {

// The number of usable CUDA devices; 0 when there is no driver or no device (the runtime loads
// the driver itself and reports its absence as an error, which is not a failure here).
int BackendDeviceCount();

// A new CudaDevice the caller owns, or null with `error` filled.
Device* BackendCreateDevice(const DeviceParams* params, BackendError* error);

}  // namespace kvpool::kernels::cuda

#pragma once

// The CUDA driver functions the backend calls directly (virtual memory management, device
// attributes), resolved at run time through the runtime's cudaGetDriverEntryPointByVersion. The
// backend never links libcuda: the static runtime finds the driver itself, so the library loads
// (and reports zero devices) on machines without one.
//
// <cuda.h> is included for its types and enums only.

#include <cuda.h>
#include <cudaTypedefs.h>

#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvpool::kernels::cuda {

// Driver entry points, each with the ABI of the version named in its type. Immutable once
// resolved; safe to share between threads.
struct DriverApi {
  PFN_cuGetErrorName_v6000 cuGetErrorName = nullptr;
  PFN_cuGetErrorString_v6000 cuGetErrorString = nullptr;
  PFN_cuDeviceGet_v2000 cuDeviceGet = nullptr;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity = nullptr;
  PFN_cuMemCreate_v10020 cuMemCreate = nullptr;
  PFN_cuMemRelease_v10020 cuMemRelease = nullptr;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree = nullptr;
  PFN_cuMemMap_v10020 cuMemMap = nullptr;
  PFN_cuMemUnmap_v10020 cuMemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle = nullptr;
};

// The process-wide table, resolved on first use (thread-safe) and kept for the process's life.
// Errors: UNAVAILABLE when the runtime cannot reach a driver; INTERNAL when the driver lacks one
// of the functions (older than CUDA 12).
absl::StatusOr<const DriverApi*> GetDriverApi();

// OK for CUDA_SUCCESS; RESOURCE_EXHAUSTED for CUDA_ERROR_OUT_OF_MEMORY; INTERNAL otherwise, with
// `what` and the driver's name and description of the error.
absl::Status DriverStatus(const DriverApi& api, CUresult result, std::string_view what);

}  // namespace kvpool::kernels::cuda

#include "kernels/cuda/driver_api.h"

#include <cuda_runtime_api.h>

#include "fmt/format.h"

namespace kvpool::kernels::cuda {
namespace {

// The driver ABI the backend is written against. Asking by version (rather than "whatever the
// driver has") keeps each function's signature equal to its PFN_*_vNNNN type above.
constexpr unsigned int kDriverAbiVersion = 12000;

template <typename Fn>
absl::Status Resolve(const char* symbol, Fn* fn) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, &address, kDriverAbiVersion,
                                                           cudaEnableDefault, &found);
  if (err != cudaSuccess) {
    // A failure here means the runtime could not load the driver at all.
    cudaGetLastError();
    return absl::UnavailableError(
        fmt::format("cannot resolve {}: {}", symbol, cudaGetErrorString(err)));
  }
  if (found != cudaDriverEntryPointSuccess || address == nullptr) {
    return absl::InternalError(fmt::format(
        "the CUDA driver lacks {} at ABI version {} (driver too old?)", symbol, kDriverAbiVersion));
  }
  *fn = reinterpret_cast<Fn>(address);
  return absl::OkStatus();
}

absl::Status ResolveAll(DriverApi* api) {
  absl::Status status;
  status.Update(Resolve("cuGetErrorName", &api->cuGetErrorName));
  status.Update(Resolve("cuGetErrorString", &api->cuGetErrorString));
  status.Update(Resolve("cuDeviceGet", &api->cuDeviceGet));
  status.Update(Resolve("cuDeviceGetAttribute", &api->cuDeviceGetAttribute));
  status.Update(Resolve("cuMemGetAllocationGranularity", &api->cuMemGetAllocationGranularity));
  status.Update(Resolve("cuMemCreate", &api->cuMemCreate));
  status.Update(Resolve("cuMemRelease", &api->cuMemRelease));
  status.Update(Resolve("cuMemAddressReserve", &api->cuMemAddressReserve));
  status.Update(Resolve("cuMemAddressFree", &api->cuMemAddressFree));
  status.Update(Resolve("cuMemMap", &api->cuMemMap));
  status.Update(Resolve("cuMemUnmap", &api->cuMemUnmap));
  status.Update(Resolve("cuMemSetAccess", &api->cuMemSetAccess));
  status.Update(Resolve("cuMemExportToShareableHandle", &api->cuMemExportToShareableHandle));
  return status;
}

}  // namespace

absl::StatusOr<const DriverApi*> GetDriverApi() {
  // Function-local statics are initialized once even under concurrent first calls.
  static const absl::StatusOr<DriverApi>* const resolved = [] {
    DriverApi api;
    absl::Status status = ResolveAll(&api);
    if (!status.ok()) return new absl::StatusOr<DriverApi>(std::move(status));
    return new absl::StatusOr<DriverApi>(api);
  }();
  if (!resolved->ok()) return resolved->status();
  return &resolved->value();
}

absl::Status DriverStatus(const DriverApi& api, CUresult result, std::string_view what) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = "?";
  const char* description = "unknown error";
  api.cuGetErrorName(result, &name);
  api.cuGetErrorString(result, &description);
  std::string message = fmt::format("{}: {} ({})", what, description, name);
  if (result == CUDA_ERROR_OUT_OF_MEMORY) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace kvpool::kernels::cuda

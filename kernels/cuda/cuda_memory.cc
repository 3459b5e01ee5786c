#include "kernels/cuda/cuda_memory.h"

#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include "fmt/format.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/driver_api.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::kernels::cuda {
namespace {

// One cuMemCreate allocation mapped at a reserved range of its own.
class VmmArena final : public Arena {
 public:
  VmmArena(const DriverApi* api, int ordinal, CUmemGenericAllocationHandle handle, CUdeviceptr base,
           int64_t bytes, int64_t mapped_bytes)
      : api_(api),
        ordinal_(ordinal),
        handle_(handle),
        base_(base),
        bytes_(bytes),
        mapped_bytes_(mapped_bytes) {}

  ~VmmArena() override {
    // Unlike cudaFree, unmapping does not wait for kernels that may still read the range.
    if (cudaSetDevice(ordinal_) == cudaSuccess) cudaDeviceSynchronize();
    api_->cuMemUnmap(base_, static_cast<size_t>(mapped_bytes_));
    api_->cuMemAddressFree(base_, static_cast<size_t>(mapped_bytes_));
    api_->cuMemRelease(handle_);
  }

  void* base() const override { return reinterpret_cast<void*>(base_); }
  int64_t bytes() const override { return bytes_; }

  absl::StatusOr<ArenaExport> Export() const override {
    int fd = -1;
    KVPOOL_RETURN_IF_ERROR(
        DriverStatus(*api_,
                     api_->cuMemExportToShareableHandle(
                         &fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                     "cuMemExportToShareableHandle"));
    ArenaExport out;
    out.kind = ArenaExport::Kind::kCudaVmm;
    out.fd = UniqueFd(fd);
    out.bytes = bytes_;
    out.mapped_bytes = mapped_bytes_;
    out.device_ordinal = ordinal_;
    return out;
  }

 private:
  const DriverApi* const api_;
  const int ordinal_;
  const CUmemGenericAllocationHandle handle_;
  const CUdeviceptr base_;
  const int64_t bytes_;
  const int64_t mapped_bytes_;
};

// One cudaMalloc allocation shared through the legacy IPC handle.
class IpcArena final : public Arena {
 public:
  IpcArena(int ordinal, void* base, int64_t bytes)
      : ordinal_(ordinal), base_(base), bytes_(bytes) {}

  ~IpcArena() override {
    if (cudaSetDevice(ordinal_) == cudaSuccess) cudaFree(base_);  // waits for the device
  }

  void* base() const override { return base_; }
  int64_t bytes() const override { return bytes_; }

  absl::StatusOr<ArenaExport> Export() const override {
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal_), "cudaSetDevice"));
    cudaIpcMemHandle_t handle;
    KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaIpcGetMemHandle(&handle, base_), "cudaIpcGetMemHandle"));
    ArenaExport out;
    out.kind = ArenaExport::Kind::kCudaIpc;
    out.ipc_handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    out.bytes = bytes_;
    out.mapped_bytes = bytes_;
    out.device_ordinal = ordinal_;
    return out;
  }

 private:
  const int ordinal_;
  void* const base_;
  const int64_t bytes_;
};

class CudaBuffer final : public DeviceBuffer {
 public:
  CudaBuffer(int ordinal, void* data, int64_t bytes)
      : ordinal_(ordinal), data_(data), bytes_(bytes) {}
  ~CudaBuffer() override {
    if (cudaSetDevice(ordinal_) == cudaSuccess) cudaFree(data_);
  }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  const int ordinal_;
  void* const data_;
  const int64_t bytes_;
};

class PinnedBuffer final : public DeviceBuffer {
 public:
  PinnedBuffer(void* data, int64_t bytes) : data_(data), bytes_(bytes) {}
  ~PinnedBuffer() override { cudaFreeHost(data_); }
  void* data() const override { return data_; }
  int64_t bytes() const override { return bytes_; }

 private:
  void* const data_;
  const int64_t bytes_;
};

absl::StatusOr<bool> VmmSupported(const DriverApi& api, CUdevice device) {
  int vmm = 0;
  int posix_fd = 0;
  KVPOOL_RETURN_IF_ERROR(
      DriverStatus(api,
                   api.cuDeviceGetAttribute(
                       &vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device),
                   "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)"));
  KVPOOL_RETURN_IF_ERROR(DriverStatus(
      api,
      api.cuDeviceGetAttribute(
          &posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, device),
      "cuDeviceGetAttribute(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)"));
  return vmm != 0 && posix_fd != 0;
}

// Zeroes a new arena before anyone can map it. Device memory comes back from the driver with
// whatever its last user left (another process's KV, another tenant's), and the block pool does
// not scrub a block's first hand-out (it had no owner), so the arena must start as zeros, as a
// CPU arena (a fresh memfd) does. Synchronous: creation is rare and nothing may race it.
absl::Status ZeroArena(void* base, size_t bytes) {
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaMemset(base, 0, bytes), "cudaMemset(arena, 0)"));
  return CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize (zeroing the arena)");
}

// Null with OK status when the driver refuses the allocation as unsupported (the caller falls
// back to cudaMalloc).
absl::StatusOr<std::unique_ptr<Arena>> CreateVmmArena(const DriverApi& api, int ordinal,
                                                      int64_t bytes) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = ordinal;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t granularity = 0;
  KVPOOL_RETURN_IF_ERROR(DriverStatus(
      api, api.cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
      "cuMemGetAllocationGranularity"));
  const auto g = static_cast<int64_t>(granularity);
  const int64_t mapped = (bytes + g - 1) / g * g;
  const auto size = static_cast<size_t>(mapped);

  CUmemGenericAllocationHandle handle = 0;
  const CUresult created = api.cuMemCreate(&handle, size, &prop, 0);
  if (created == CUDA_ERROR_NOT_SUPPORTED) return std::unique_ptr<Arena>();
  KVPOOL_RETURN_IF_ERROR(DriverStatus(
      api, created, fmt::format("cuMemCreate({} bytes on device {})", mapped, ordinal)));

  CUdeviceptr base = 0;
  if (absl::Status s = DriverStatus(api, api.cuMemAddressReserve(&base, size, granularity, 0, 0),
                                    "cuMemAddressReserve");
      !s.ok()) {
    api.cuMemRelease(handle);
    return s;
  }
  if (absl::Status s = DriverStatus(api, api.cuMemMap(base, size, 0, handle, 0), "cuMemMap");
      !s.ok()) {
    api.cuMemAddressFree(base, size);
    api.cuMemRelease(handle);
    return s;
  }
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (absl::Status s =
          DriverStatus(api, api.cuMemSetAccess(base, size, &access, 1), "cuMemSetAccess");
      !s.ok()) {
    api.cuMemUnmap(base, size);
    api.cuMemAddressFree(base, size);
    api.cuMemRelease(handle);
    return s;
  }
  auto arena = std::make_unique<VmmArena>(&api, ordinal, handle, base, bytes, mapped);
  KVPOOL_RETURN_IF_ERROR(ZeroArena(reinterpret_cast<void*>(base), size));
  return std::unique_ptr<Arena>(std::move(arena));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Arena>> CreateCudaArena(int ordinal, int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError("arena size must be > 0");
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice"));
  KVPOOL_ASSIGN_OR_RETURN(const DriverApi* api, GetDriverApi());
  CUdevice device = 0;
  KVPOOL_RETURN_IF_ERROR(DriverStatus(*api, api->cuDeviceGet(&device, ordinal), "cuDeviceGet"));
  KVPOOL_ASSIGN_OR_RETURN(const bool vmm, VmmSupported(*api, device));
  if (vmm) {
    KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<Arena> arena, CreateVmmArena(*api, ordinal, bytes));
    if (arena != nullptr) return arena;
  }
  void* base = nullptr;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaMalloc(&base, static_cast<size_t>(bytes)),
                 fmt::format("cudaMalloc({} bytes on device {})", bytes, ordinal)));
  auto arena = std::make_unique<IpcArena>(ordinal, base, bytes);
  KVPOOL_RETURN_IF_ERROR(ZeroArena(base, static_cast<size_t>(bytes)));
  return std::unique_ptr<Arena>(std::move(arena));
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateCudaBuffer(int ordinal, int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError("buffer size must be > 0");
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice"));
  void* data = nullptr;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaMalloc(&data, static_cast<size_t>(bytes)),
                 fmt::format("cudaMalloc({} bytes on device {})", bytes, ordinal)));
  return std::unique_ptr<DeviceBuffer>(std::make_unique<CudaBuffer>(ordinal, data, bytes));
}

absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocatePinnedBuffer(int ordinal, int64_t bytes) {
  if (bytes <= 0) return absl::InvalidArgumentError("buffer size must be > 0");
  KVPOOL_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(ordinal), "cudaSetDevice"));
  void* data = nullptr;
  KVPOOL_RETURN_IF_ERROR(
      CudaStatus(cudaMallocHost(&data, static_cast<size_t>(bytes)),
                 fmt::format("cudaMallocHost({} bytes for device {})", bytes, ordinal)));
  return std::unique_ptr<DeviceBuffer>(std::make_unique<PinnedBuffer>(data, bytes));
}

}  // namespace kvpool::kernels::cuda

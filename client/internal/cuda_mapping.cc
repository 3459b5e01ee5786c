#include "client/internal/cuda_mapping.h"

#include "absl/status/status.h"

#if __has_include(<cuda.h>) && __has_include(<cudaTypedefs.h>)
#define KVPOOL_CLIENT_HAVE_CUDA_H 1
#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>

#include <cstring>
#include <string>

#include "fmt/format.h"
#include "kvpool/util/status_macros.h"
#endif

namespace kvpool::client::internal {

#ifdef KVPOOL_CLIENT_HAVE_CUDA_H
namespace {

// Driver entry points by their exported symbol names, each with the ABI of that symbol (the
// unversioned names are the oldest ABI; `_v2` names are what <cuda.h> maps calls to today).
struct Driver {
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuInit_v2000 init = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 primary_ctx_retain = nullptr;
  PFN_cuDevicePrimaryCtxRelease_v11000 primary_ctx_release = nullptr;
  PFN_cuCtxSetCurrent_v4000 ctx_set_current = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuIpcOpenMemHandle_v11000 ipc_open = nullptr;
  PFN_cuIpcCloseMemHandle_v4010 ipc_close = nullptr;
};

template <typename Fn>
absl::Status Resolve(void* library, const char* symbol, Fn* fn) {
  void* address = dlsym(library, symbol);
  if (address == nullptr) {
    return absl::InternalError(fmt::format("the CUDA driver lacks {} (driver too old?)", symbol));
  }
  *fn = reinterpret_cast<Fn>(address);
  return absl::OkStatus();
}

absl::StatusOr<Driver> LoadDriver() {
  // Never closed: the driver stays loaded for the life of the process, as it would if linked.
  void* library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    return absl::UnavailableError(fmt::format("no CUDA driver: dlopen(libcuda.so.1): {}",
                                              why != nullptr ? why : "unknown error"));
  }
  Driver d;
  absl::Status status;
  status.Update(Resolve(library, "cuGetErrorName", &d.get_error_name));
  status.Update(Resolve(library, "cuGetErrorString", &d.get_error_string));
  status.Update(Resolve(library, "cuInit", &d.init));
  status.Update(Resolve(library, "cuDeviceGet", &d.device_get));
  status.Update(Resolve(library, "cuDevicePrimaryCtxRetain", &d.primary_ctx_retain));
  status.Update(Resolve(library, "cuDevicePrimaryCtxRelease_v2", &d.primary_ctx_release));
  status.Update(Resolve(library, "cuCtxSetCurrent", &d.ctx_set_current));
  status.Update(Resolve(library, "cuMemImportFromShareableHandle", &d.mem_import));
  status.Update(Resolve(library, "cuMemAddressReserve", &d.mem_address_reserve));
  status.Update(Resolve(library, "cuMemAddressFree", &d.mem_address_free));
  status.Update(Resolve(library, "cuMemMap", &d.mem_map));
  status.Update(Resolve(library, "cuMemUnmap", &d.mem_unmap));
  status.Update(Resolve(library, "cuMemSetAccess", &d.mem_set_access));
  status.Update(Resolve(library, "cuMemRelease", &d.mem_release));
  status.Update(Resolve(library, "cuIpcOpenMemHandle_v2", &d.ipc_open));
  status.Update(Resolve(library, "cuIpcCloseMemHandle", &d.ipc_close));
  if (!status.ok()) return status;
  return d;
}

// The process-wide table, loaded on first use (thread-safe static initialization).
absl::StatusOr<const Driver*> GetDriver() {
  static const absl::StatusOr<Driver>* const loaded = new absl::StatusOr<Driver>(LoadDriver());
  if (!loaded->ok()) return loaded->status();
  return &loaded->value();
}

absl::Status Check(const Driver& d, CUresult result, const std::string& what) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = "?";
  const char* description = "unknown error";
  d.get_error_name(result, &name);
  d.get_error_string(result, &description);
  std::string message = fmt::format("{}: {} ({})", what, description, name);
  if (result == CUDA_ERROR_OUT_OF_MEMORY) return absl::ResourceExhaustedError(std::move(message));
  return absl::InternalError(std::move(message));
}

// cuInit, then retain device `ordinal`'s primary context and make it current on this thread.
absl::Status EnterPrimaryContext(const Driver& d, int ordinal) {
  KVPOOL_RETURN_IF_ERROR(Check(d, d.init(0), "cuInit"));
  CUdevice device = 0;
  KVPOOL_RETURN_IF_ERROR(
      Check(d, d.device_get(&device, ordinal), fmt::format("cuDeviceGet({})", ordinal)));
  CUcontext context = nullptr;
  KVPOOL_RETURN_IF_ERROR(
      Check(d, d.primary_ctx_retain(&context, device), "cuDevicePrimaryCtxRetain"));
  if (absl::Status s = Check(d, d.ctx_set_current(context), "cuCtxSetCurrent"); !s.ok()) {
    d.primary_ctx_release(device);
    return s;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaMapping>> CudaMapping::ImportVmm(int fd, int64_t mapped_bytes,
                                                                    int device_ordinal) {
  KVPOOL_ASSIGN_OR_RETURN(const Driver* d, GetDriver());
  KVPOOL_RETURN_IF_ERROR(EnterPrimaryContext(*d, device_ordinal));
  // From here the destructor undoes whatever succeeded.
  std::unique_ptr<CudaMapping> m(new CudaMapping(Kind::kVmm, device_ordinal));
  m->context_retained_ = true;
  m->bytes_ = static_cast<uint64_t>(mapped_bytes);

  CUmemGenericAllocationHandle handle = 0;
  KVPOOL_RETURN_IF_ERROR(
      Check(*d,
            d->mem_import(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "cuMemImportFromShareableHandle"));
  m->alloc_handle_ = handle;
  CUdeviceptr ptr = 0;
  KVPOOL_RETURN_IF_ERROR(Check(*d, d->mem_address_reserve(&ptr, m->bytes_, 0, 0, 0),
                               fmt::format("cuMemAddressReserve({} bytes)", mapped_bytes)));
  m->device_ptr_ = ptr;
  KVPOOL_RETURN_IF_ERROR(Check(*d, d->mem_map(ptr, m->bytes_, 0, handle, 0), "cuMemMap"));
  m->mapped_ = true;
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_ordinal;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  KVPOOL_RETURN_IF_ERROR(
      Check(*d, d->mem_set_access(ptr, m->bytes_, &access, 1), "cuMemSetAccess"));
  return m;
}

absl::StatusOr<std::unique_ptr<CudaMapping>> CudaMapping::OpenIpc(std::string_view handle,
                                                                  int device_ordinal) {
  CUipcMemHandle ipc = {};
  if (handle.size() != sizeof(ipc)) {
    return absl::InvalidArgumentError(fmt::format(
        "cuda_ipc_handle holds {} bytes, a CUipcMemHandle is {}", handle.size(), sizeof(ipc)));
  }
  std::memcpy(&ipc, handle.data(), sizeof(ipc));
  KVPOOL_ASSIGN_OR_RETURN(const Driver* d, GetDriver());
  KVPOOL_RETURN_IF_ERROR(EnterPrimaryContext(*d, device_ordinal));
  std::unique_ptr<CudaMapping> m(new CudaMapping(Kind::kIpc, device_ordinal));
  m->context_retained_ = true;
  CUdeviceptr ptr = 0;
  KVPOOL_RETURN_IF_ERROR(
      Check(*d, d->ipc_open(&ptr, ipc, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle"));
  m->device_ptr_ = ptr;
  return m;
}

CudaMapping::~CudaMapping() {
  absl::StatusOr<const Driver*> loaded = GetDriver();
  if (!loaded.ok()) return;  // nothing can have been imported
  const Driver& d = **loaded;
  CUdevice device = 0;
  CUcontext context = nullptr;
  // Unmapping needs the context current on this thread, which need not be the importing one.
  if (context_retained_ && d.device_get(&device, device_ordinal_) == CUDA_SUCCESS &&
      d.primary_ctx_retain(&context, device) == CUDA_SUCCESS) {
    d.ctx_set_current(context);
    d.primary_ctx_release(device);  // the extra reference just taken
  }
  switch (kind_) {
    case Kind::kVmm:
      if (mapped_) d.mem_unmap(device_ptr_, bytes_);
      if (device_ptr_ != 0) d.mem_address_free(device_ptr_, bytes_);
      if (alloc_handle_ != 0) d.mem_release(alloc_handle_);
      break;
    case Kind::kIpc:
      if (device_ptr_ != 0) d.ipc_close(device_ptr_);
      break;
  }
  if (context_retained_ && d.device_get(&device, device_ordinal_) == CUDA_SUCCESS) {
    d.primary_ctx_release(device);
  }
}

#else  // !KVPOOL_CLIENT_HAVE_CUDA_H

absl::StatusOr<std::unique_ptr<CudaMapping>> CudaMapping::ImportVmm(int, int64_t, int) {
  return absl::UnimplementedError(
      "this kvpool client was built without <cuda.h> and cannot map a CUDA pool");
}

absl::StatusOr<std::unique_ptr<CudaMapping>> CudaMapping::OpenIpc(std::string_view, int) {
  return absl::UnimplementedError(
      "this kvpool client was built without <cuda.h> and cannot map a CUDA pool");
}

CudaMapping::~CudaMapping() = default;

#endif  // KVPOOL_CLIENT_HAVE_CUDA_H

}  // namespace kvpool::client::internal

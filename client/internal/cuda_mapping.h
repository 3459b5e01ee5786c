#pragma once

// CudaMapping: the daemon's CUDA arena imported into this process through the CUDA driver API,
// which is loaded at run time (dlopen "libcuda.so.1"), so the client library links no CUDA and
// runs on machines without a driver. Compiled only where the toolkit's <cuda.h> is available
// (for types); elsewhere every import returns UNIMPLEMENTED.
//
// The import retains the device's primary context and makes it current on the calling thread
// (cuCtxSetCurrent), as a CUDA client of the pool will want anyway. `device_ordinal` is the
// daemon's numbering: the client must see the same devices (same CUDA_VISIBLE_DEVICES).
//
// Thread-safety: immutable after creation. Ownership: owns the imported allocation, the reserved
// address range and a primary-context reference; the destructor releases them. It does not own
// the descriptor it was given.

#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvpool::client::internal {

class CudaMapping final {
 public:
  // Imports a cuMemCreate allocation exported as a POSIX file descriptor and maps
  // `mapped_bytes` of it read-write for device `device_ordinal`.
  // Errors: UNAVAILABLE (no loadable driver), UNIMPLEMENTED (built without <cuda.h>),
  // RESOURCE_EXHAUSTED (out of memory / address space), INTERNAL (any other driver failure).
  static absl::StatusOr<std::unique_ptr<CudaMapping>> ImportVmm(int fd, int64_t mapped_bytes,
                                                                int device_ordinal);
  // Opens a legacy IPC handle (cuIpcOpenMemHandle, the driver twin of cudaIpcOpenMemHandle).
  // Errors: as ImportVmm, plus INVALID_ARGUMENT when `handle` is not a CUipcMemHandle.
  static absl::StatusOr<std::unique_ptr<CudaMapping>> OpenIpc(std::string_view handle,
                                                              int device_ordinal);

  CudaMapping(const CudaMapping&) = delete;
  CudaMapping& operator=(const CudaMapping&) = delete;
  ~CudaMapping();

  // The device address of the arena's first byte; not host-accessible.
  char* base() const { return reinterpret_cast<char*>(static_cast<uintptr_t>(device_ptr_)); }

 private:
  enum class Kind : uint8_t { kVmm, kIpc };
  CudaMapping(Kind kind, int device_ordinal) : kind_(kind), device_ordinal_(device_ordinal) {}

  const Kind kind_;
  const int device_ordinal_;
  uint64_t device_ptr_ = 0;    // CUdeviceptr
  uint64_t bytes_ = 0;         // reserved and mapped (VMM only)
  uint64_t alloc_handle_ = 0;  // CUmemGenericAllocationHandle (VMM only)
  bool mapped_ = false;        // cuMemMap succeeded (VMM only)
  bool context_retained_ = false;
};

}  // namespace kvpool::client::internal

#pragma once

// Device memory of the CUDA backend: the shareable pool arena and scratch buffers.

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/device.h"

namespace kvpool::kernels::cuda {

// The pool arena on device `ordinal`, `bytes` long (a positive size).
//
// Preferred: one cuMemCreate allocation with a POSIX-fd shareable handle, its size rounded up to
// the allocation granularity, reserved, mapped and made read/write for the device; Export()
// returns kCudaVmm with a fresh fd per call. When the device lacks VMM or POSIX-fd handles (or
// the driver refuses such an allocation as unsupported), one cudaMalloc allocation whose Export()
// returns kCudaIpc with the raw cudaIpcMemHandle_t.
//
// The arena is independent of any Device object and may outlive it. Destroying it waits for all
// work on the device (a kernel may still read the pool) before unmapping and freeing; fds already
// exported stay valid for their holders. Thread-safe (immutable after creation).
//
// Errors: INVALID_ARGUMENT for bytes <= 0; RESOURCE_EXHAUSTED when the device is out of memory;
// UNAVAILABLE without a driver; INTERNAL for other CUDA failures (nothing is left allocated).
absl::StatusOr<std::unique_ptr<Arena>> CreateCudaArena(int ordinal, int64_t bytes);

// A cudaMalloc scratch buffer (`bytes` > 0) on device `ordinal`, freed (cudaFree, which waits for
// the device) when destroyed. Errors: INVALID_ARGUMENT for bytes <= 0; RESOURCE_EXHAUSTED when
// out of memory; INTERNAL otherwise.
absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocateCudaBuffer(int ordinal, int64_t bytes);

// Page-locked host memory (cudaMallocHost, `bytes` > 0) for asynchronous copies with device
// `ordinal`, freed (cudaFreeHost) when destroyed. Errors as AllocateCudaBuffer.
absl::StatusOr<std::unique_ptr<DeviceBuffer>> AllocatePinnedBuffer(int ordinal, int64_t bytes);

}  // namespace kvpool::kernels::cuda

#pragma once

// Picks and creates a Device: the CPU device (always available) or the CUDA backend, a shared
// library (libkvpool_cuda.so) loaded at run time so every binary starts on machines without the
// NVIDIA driver or toolkit.
//
// A backend library exports two C symbols:
//   int kvpool_backend_device_count(void);            // usable devices; 0 without a driver
//   kvpool::kernels::Device* kvpool_backend_create_device(int ordinal, char* error,
//                                                         size_t error_bytes);
// The second returns a heap object the caller owns, or null with a message in `error`.

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "kernels/device.h"

namespace kvpool::kernels {

enum class BackendKind : uint8_t {
  kAuto,  // CUDA when the backend loads and sees a device, else CPU
  kCpu,
  kCuda,
};

// "auto", "cpu", "cuda". Errors: INVALID_ARGUMENT.
absl::StatusOr<BackendKind> ParseBackend(std::string_view name);

struct BackendOptions {
  BackendKind kind = BackendKind::kAuto;
  int device_ordinal = 0;
  int cpu_threads = 0;  // CPU device worker threads for kernels; 0 = hardware concurrency
};

// Errors: UNAVAILABLE when kCuda is asked for and the library or a device is missing (with why),
// INTERNAL when a device fails to start.
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(const BackendOptions& options);

// Where CreateDevice looked for the CUDA backend and what happened (for logs and --help).
std::string DescribeCudaBackend();

// Another entry point of the CUDA backend (the model's: model/step_model.cc), or null when the
// backend did not load or lacks it. Loads the backend if no one has yet.
void* CudaBackendSymbol(const char* name);

}  // namespace kvpool::kernels

#pragma once

// The backend registry: which backends this process has and the devices they make. A backend is
// described by a BackendReg (backend_api.h, after ggml's ggml_backend_reg): the CPU backend's is
// built in; every other backend is a plug-in library (libkvpool_cuda.so) loaded at run time, so
// every binary starts on machines without the NVIDIA driver or toolkit. A plug-in whose library
// is missing, lacks kvpool_backend_init or was built for another backend API version does not
// load, with a message saying which; `auto` then falls back to the CPU and `cuda` is refused.
//
// Thread-safe. Plug-ins load once per process and stay mapped for its life (the devices and
// models they make point into them); the registrations returned live as long.

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend_api.h"
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
// INVALID_ARGUMENT for an ordinal the backend does not have, INTERNAL (or the backend's code)
// when a device fails to start.
absl::StatusOr<std::unique_ptr<Device>> CreateDevice(const BackendOptions& options);

// The built-in CPU backend.
const BackendReg& CpuBackend();

// Loads the plug-in at `path` (no search) and returns its registration; the library stays loaded.
// Errors (the library is unloaded again): NOT_FOUND when it cannot be loaded or exports no
// kvpool_backend_init ("not a kvpool backend"); FAILED_PRECONDITION when it was built for another
// kBackendApiVersion (both named) or its registration is incomplete.
absl::StatusOr<const BackendReg*> LoadBackendLibrary(const std::string& path);

// The plug-in `name` ("cuda": libkvpool_cuda.so), looked for in $KVPOOL_BACKEND_DIR, beside the
// executable, in ../lib/kvpool and ../lib beside it (the installed layout), in the build tree's
// lib/, then on the loader's path; the first that exists decides (a stale copy there is an error,
// never masked by another further down). Loaded once per process (the result,
// success or not, is remembered). Errors: UNAVAILABLE, with every candidate's reason.
absl::StatusOr<const BackendReg*> PluginBackend(std::string_view name);

// The registry names of every backend this build knows of: "cpu", then each plug-in ("cuda"),
// whether or not it loads here.
std::vector<std::string_view> KnownBackends();

// Every backend that loaded: the CPU backend first, then each plug-in this build knows of that
// loaded (whether or not it sees a device).
std::vector<const BackendReg*> LoadedBackends();

// The loaded backend that made `device` (the leading letters and digits of its name()).
// Errors: NOT_FOUND.
absl::StatusOr<const BackendReg*> BackendOf(const Device& device);

// Where the CUDA backend was looked for and what happened (for logs and --help).
std::string DescribeCudaBackend();

}  // namespace kvpool::kernels

#pragma once

// The backend plug-in interface, in the manner of ggml's ggml_backend_reg: a backend (a device,
// its KV kernels and, where the pool is not host memory, its model) is described by one
// BackendReg. The CPU backend's is built in (kernels/backend.cc); a plug-in library
// (libkvpool_<name>.so, loaded at run time so every binary starts without that backend's driver)
// exports exactly one symbol:
//
//   extern "C" const kvpool::kernels::BackendReg* kvpool_backend_init(void);
//
// returning a registration that lives as long as the library. The loader (kernels/backend.h)
// reads `api_version` first and refuses a library built against another version with a message
// naming both, so a stale plug-in left in a plug-in directory is an error and never undefined
// behaviour. Anything that changes this struct, DeviceParams, BackendError or the meaning of a
// field increments kBackendApiVersion; `api_version` stays the first member.
//
// Both sides are C++ built by the same toolchain from the same tree (the structs hold C++ types),
// so the ABI is that of this header at one version, not a stable C ABI.
//
// The model factory names the model layer's types by declaration only: kernels/ includes nothing
// above it (DESIGN.md §2), and model/step_model.cc is its only caller.

#include <cstddef>
#include <cstdint>

#include "kernels/device.h"
#include "kernels/pool_layout.h"

namespace kvpool::model {
class StepModel;
struct ModelWeights;
}  // namespace kvpool::model

namespace kvpool::kernels {

// Version 1: name, device_count, create_device, create_model, get_proc_address.
inline constexpr uint32_t kBackendApiVersion = 1;

// The name of the one symbol a plug-in exports.
inline constexpr char kBackendInitSymbol[] = "kvpool_backend_init";

// What a failing factory says: an absl::StatusCode and a NUL-terminated message.
struct BackendError {
  int code = 0;
  char message[512] = {0};
};

struct DeviceParams {
  int ordinal = 0;      // which of the backend's device_count() devices
  int cpu_threads = 0;  // kernel worker threads of a host device; 0 = hardware concurrency
};

struct BackendReg {
  uint32_t api_version = 0;  // kBackendApiVersion of the tree the backend was built from
  const char* name = "";     // "cpu", "cuda": the prefix of its devices' Device::name()
  // Usable devices; 0 when the driver or the hardware is missing (which is not an error).
  int (*device_count)() = nullptr;
  // A new device the caller owns, or null with `error` filled.
  // REQUIRES: 0 <= params->ordinal < device_count().
  Device* (*create_device)(const DeviceParams* params, BackendError* error) = nullptr;
  // A new model the caller owns over `device` (one this backend made), taking the weights out of
  // `*weights`; or null with `error` filled. Null when the backend's devices are host-visible:
  // the host model (model/model.h) then runs over their pools.
  // REQUIRES: model::CheckModel(*weights, *layout).ok().
  model::StepModel* (*create_model)(Device* device, model::ModelWeights* weights,
                                    const PoolLayout* layout, BackendError* error) = nullptr;
  // A further entry point by name (ggml's get_proc_address), or null: extensions that do not
  // warrant a new API version. Never null itself.
  void* (*get_proc_address)(const char* name) = nullptr;
};

using BackendInitFn = const BackendReg* (*)();

}  // namespace kvpool::kernels

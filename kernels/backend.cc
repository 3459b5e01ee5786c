#include "kernels/backend.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

#include "fmt/format.h"
#include "kernels/cpu_device.h"
#include "kvpool/util/logging.h"

namespace kvpool::kernels {
namespace {

constexpr char kCudaLibrary[] = "libkvpool_cuda.so";

using DeviceCountFn = int (*)();
using CreateDeviceFn = Device* (*)(int, char*, size_t);

// Where the backend may be: $KVPOOL_BACKEND_DIR, beside the executable, ../lib/kvpool beside it
// (the installed layout: /usr/bin/kvpoold, /usr/lib/kvpool/libkvpool_cuda.so, a private plug-in
// directory, cmake/Packaging.cmake), ../lib beside it, the build tree's lib/ (so uninstalled
// builds work), then the loader's own search path.
std::vector<std::string> Candidates() {
  std::vector<std::string> out;
  if (const char* dir = std::getenv("KVPOOL_BACKEND_DIR")) {
    out.push_back((std::filesystem::path(dir) / kCudaLibrary).string());
  }
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    out.push_back((exe.parent_path() / kCudaLibrary).string());
    out.push_back((exe.parent_path() / ".." / "lib" / "kvpool" / kCudaLibrary).string());
    out.push_back((exe.parent_path() / ".." / "lib" / kCudaLibrary).string());
  }
#ifdef KVPOOL_BUILD_LIB_DIR
  out.push_back((std::filesystem::path(KVPOOL_BUILD_LIB_DIR) / kCudaLibrary).string());
#endif
  out.push_back(kCudaLibrary);
  return out;
}

struct CudaBackend {
  void* handle = nullptr;
  std::string path;
  std::string why;  // when not loaded
  DeviceCountFn device_count = nullptr;
  CreateDeviceFn create = nullptr;
};

// Loaded once; the library stays mapped for the life of the process (devices it made point
// into it).
const CudaBackend& LoadCuda() {
  static const CudaBackend backend = [] {
    CudaBackend b;
    std::vector<std::string> errors;
    for (const std::string& path : Candidates()) {
      if (path.find('/') != std::string::npos && !std::filesystem::exists(path)) continue;
      void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) {
        errors.push_back(dlerror());
        continue;
      }
      b.device_count =
          reinterpret_cast<DeviceCountFn>(dlsym(handle, "kvpool_backend_device_count"));
      b.create = reinterpret_cast<CreateDeviceFn>(dlsym(handle, "kvpool_backend_create_device"));
      if (b.device_count == nullptr || b.create == nullptr) {
        errors.push_back(fmt::format("{}: not a kvpool backend", path));
        dlclose(handle);
        continue;
      }
      b.handle = handle;
      b.path = path;
      return b;
    }
    b.why = errors.empty() ? fmt::format("{} not found (built without CUDA?)", kCudaLibrary)
                           : fmt::format("{}", fmt::join(errors, "; "));
    return b;
  }();
  return backend;
}

absl::StatusOr<std::unique_ptr<Device>> CreateCuda(int ordinal) {
  const CudaBackend& b = LoadCuda();
  if (b.handle == nullptr) return absl::UnavailableError("CUDA backend: " + b.why);
  const int count = b.device_count();
  if (count <= 0) {
    return absl::UnavailableError(
        fmt::format("CUDA backend {} loaded but sees no device (no driver or no GPU)", b.path));
  }
  if (ordinal < 0 || ordinal >= count) {
    return absl::InvalidArgumentError(
        fmt::format("CUDA device {} requested, {} present", ordinal, count));
  }
  char error[512] = {0};
  Device* device = b.create(ordinal, error, sizeof(error));
  if (device == nullptr)
    return absl::InternalError(fmt::format("CUDA device {}: {}", ordinal, error));
  return std::unique_ptr<Device>(device);
}

}  // namespace

absl::StatusOr<BackendKind> ParseBackend(std::string_view name) {
  if (name == "auto") return BackendKind::kAuto;
  if (name == "cpu") return BackendKind::kCpu;
  if (name == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError(fmt::format("unknown backend '{}' (auto, cpu, cuda)", name));
}

absl::StatusOr<std::unique_ptr<Device>> CreateDevice(const BackendOptions& options) {
  switch (options.kind) {
    case BackendKind::kCpu:
      return std::unique_ptr<Device>(new CpuDevice(options.cpu_threads));
    case BackendKind::kCuda:
      return CreateCuda(options.device_ordinal);
    case BackendKind::kAuto: {
      absl::StatusOr<std::unique_ptr<Device>> cuda = CreateCuda(options.device_ordinal);
      if (cuda.ok()) return cuda;
      Logger("kernels").info("using the CPU device ({})", std::string(cuda.status().message()));
      return std::unique_ptr<Device>(new CpuDevice(options.cpu_threads));
    }
  }
  return absl::InvalidArgumentError("unknown backend kind");
}

std::string DescribeCudaBackend() {
  const CudaBackend& b = LoadCuda();
  if (b.handle == nullptr) return "CUDA backend unavailable: " + b.why;
  return fmt::format("CUDA backend {} ({} device(s))", b.path, b.device_count());
}

void* CudaBackendSymbol(const char* name) {
  const CudaBackend& b = LoadCuda();
  return b.handle == nullptr ? nullptr : dlsym(b.handle, name);
}

}  // namespace kvpool::kernels

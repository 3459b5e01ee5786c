#include "kernels/backend.h"

#include <dlfcn.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/synchronization/mutex.h"
#include "fmt/format.h"
#include "kernels/cpu_device.h"
#include "kvpool/util/logging.h"

namespace kvpool::kernels {
namespace {

// The plug-ins this build knows of, by registry name.
constexpr std::string_view kPlugins[] = {"cuda"};

// --- The built-in CPU backend ---------------------------------------------------------------

int CpuDeviceCount() { return 1; }

Device* CpuCreateDevice(const DeviceParams* params, BackendError* /*error*/) {
  return new CpuDevice(params->cpu_threads);
}

void* CpuProcAddress(const char* /*name*/) { return nullptr; }

constexpr BackendReg kCpuBackend{
    .api_version = kBackendApiVersion,
    .name = "cpu",
    .device_count = CpuDeviceCount,
    .create_device = CpuCreateDevice,
    .create_model = nullptr,  // the host model runs over its pools
    .get_proc_address = CpuProcAddress,
};

// --- Plug-ins -------------------------------------------------------------------------------

std::string LibraryName(std::string_view name) { return fmt::format("libkvpool_{}.so", name); }

// Where the plug-in may be: $KVPOOL_BACKEND_DIR, beside the executable, ../lib/kvpool beside it
// (the installed layout: /usr/bin/kvpoold, /usr/lib/kvpool/libkvpool_cuda.so, a private plug-in
// directory, cmake/Packaging.cmake), ../lib beside it, the build tree's lib/ (so uninstalled
// builds work), then the loader's own search path. The first of these that exists decides.
std::vector<std::string> Candidates(const std::string& library) {
  std::vector<std::string> out;
  if (const char* dir = std::getenv("KVPOOL_BACKEND_DIR")) {
    out.push_back((std::filesystem::path(dir) / library).string());
  }
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    out.push_back((exe.parent_path() / library).string());
    out.push_back((exe.parent_path() / ".." / "lib" / "kvpool" / library).string());
    out.push_back((exe.parent_path() / ".." / "lib" / library).string());
  }
#ifdef KVPOOL_BUILD_LIB_DIR
  out.push_back((std::filesystem::path(KVPOOL_BUILD_LIB_DIR) / library).string());
#endif
  out.push_back(library);
  return out;
}

absl::Status CheckRegistration(const BackendReg& reg, const std::string& path) {
  if (reg.api_version != kBackendApiVersion) {
    return absl::FailedPreconditionError(
        fmt::format("{} was built for kvpool backend API {}, this program speaks {}: rebuild or "
                    "reinstall the backend with the program",
                    path, reg.api_version, kBackendApiVersion));
  }
  if (reg.name == nullptr || reg.name[0] == '\0' || reg.device_count == nullptr ||
      reg.create_device == nullptr || reg.get_proc_address == nullptr) {
    return absl::FailedPreconditionError(
        fmt::format("{}: incomplete backend registration (a name and every factory but "
                    "create_model are required)",
                    path));
  }
  return absl::OkStatus();
}

struct LoadedPlugin {
  absl::StatusOr<const BackendReg*> reg = absl::UnknownError("not loaded yet");
  std::string path;  // where it loaded from
};

ABSL_CONST_INIT absl::Mutex plugins_mu(absl::kConstInit);
// One entry per plug-in ever asked for; entries are never removed (see the header).
std::map<std::string, LoadedPlugin, std::less<>>& Plugins()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(plugins_mu) {
  static auto* plugins = new std::map<std::string, LoadedPlugin, std::less<>>;
  return *plugins;
}

LoadedPlugin SearchPlugin(std::string_view name) {
  const std::string library = LibraryName(name);
  std::vector<std::string> errors;
  for (const std::string& path : Candidates(library)) {
    if (path.find('/') != std::string::npos && !std::filesystem::exists(path)) continue;
    absl::StatusOr<const BackendReg*> reg = LoadBackendLibrary(path);
    if (reg.ok() && std::string_view((*reg)->name) != name) {
      reg = absl::FailedPreconditionError(
          fmt::format("{} registers backend '{}', not '{}'", path, (*reg)->name, name));
    }
    if (reg.ok()) return {.reg = *reg, .path = path};
    errors.push_back(std::string(reg.status().message()));
    // A library that is there but does not load (another API version, not a backend, a missing
    // dependency) is the answer: a copy further down the list must not mask a stale plug-in.
    if (path.find('/') != std::string::npos) break;
  }
  const std::string why = errors.empty() ? fmt::format("{} not found (built without it?)", library)
                                         : fmt::format("{}", fmt::join(errors, "; "));
  return {.reg = absl::UnavailableError(fmt::format("{} backend: {}", name, why))};
}

const LoadedPlugin& Plugin(std::string_view name) {
  absl::MutexLock lock(&plugins_mu);
  auto it = Plugins().find(name);
  if (it == Plugins().end()) it = Plugins().emplace(std::string(name), SearchPlugin(name)).first;
  return it->second;
}

// `path`: where a plug-in was loaded from (empty for the built-in CPU backend), for messages.
absl::StatusOr<std::unique_ptr<Device>> CreateFrom(const BackendReg& reg, const std::string& path,
                                                   const BackendOptions& options) {
  const int count = reg.device_count();
  if (count <= 0) {
    return absl::UnavailableError(
        fmt::format("{} backend {} loaded but sees no device (no driver or no hardware)",
                    absl::AsciiStrToUpper(reg.name), path));
  }
  if (options.device_ordinal < 0 || options.device_ordinal >= count) {
    return absl::InvalidArgumentError(
        fmt::format("{} device {} requested, {} present", reg.name, options.device_ordinal, count));
  }
  const DeviceParams params{.ordinal = options.device_ordinal, .cpu_threads = options.cpu_threads};
  BackendError error;
  Device* device = reg.create_device(&params, &error);
  if (device == nullptr) {
    const auto code =
        error.code == 0 ? absl::StatusCode::kInternal : static_cast<absl::StatusCode>(error.code);
    return absl::Status(code,
                        fmt::format("{} device {}: {}", reg.name, params.ordinal, error.message));
  }
  return std::unique_ptr<Device>(device);
}

absl::StatusOr<std::unique_ptr<Device>> CreateCuda(const BackendOptions& options) {
  const LoadedPlugin& cuda = Plugin("cuda");
  if (!cuda.reg.ok()) return cuda.reg.status();
  return CreateFrom(**cuda.reg, cuda.path, options);
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
      return CreateFrom(kCpuBackend, "", {.device_ordinal = 0, .cpu_threads = options.cpu_threads});
    case BackendKind::kCuda:
      return CreateCuda(options);
    case BackendKind::kAuto: {
      absl::StatusOr<std::unique_ptr<Device>> cuda = CreateCuda(options);
      if (cuda.ok()) return cuda;
      Logger("kernels").info("using the CPU device ({})", std::string(cuda.status().message()));
      return CreateFrom(kCpuBackend, "", {.device_ordinal = 0, .cpu_threads = options.cpu_threads});
    }
  }
  return absl::InvalidArgumentError("unknown backend kind");
}

const BackendReg& CpuBackend() { return kCpuBackend; }

absl::StatusOr<const BackendReg*> LoadBackendLibrary(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return absl::NotFoundError(dlerror());
  auto init = reinterpret_cast<BackendInitFn>(dlsym(handle, kBackendInitSymbol));
  if (init == nullptr) {
    dlclose(handle);
    return absl::NotFoundError(
        fmt::format("{}: not a kvpool backend (no {})", path, kBackendInitSymbol));
  }
  const BackendReg* reg = init();
  absl::Status bad = reg == nullptr
                         ? absl::FailedPreconditionError(fmt::format(
                               "{}: {} returned no registration", path, kBackendInitSymbol))
                         : CheckRegistration(*reg, path);
  if (!bad.ok()) {
    dlclose(handle);
    return bad;
  }
  return reg;  // the handle is never closed: devices and models point into the library
}

absl::StatusOr<const BackendReg*> PluginBackend(std::string_view name) { return Plugin(name).reg; }

std::vector<std::string_view> KnownBackends() {
  std::vector<std::string_view> out = {kCpuBackend.name};
  out.insert(out.end(), std::begin(kPlugins), std::end(kPlugins));
  return out;
}

std::vector<const BackendReg*> LoadedBackends() {
  std::vector<const BackendReg*> out = {&kCpuBackend};
  for (std::string_view name : kPlugins) {
    if (const LoadedPlugin& p = Plugin(name); p.reg.ok()) out.push_back(*p.reg);
  }
  return out;
}

absl::StatusOr<const BackendReg*> BackendOf(const Device& device) {
  const std::string name = device.name();
  size_t end = 0;
  while (end < name.size() && std::isalnum(static_cast<unsigned char>(name[end]))) ++end;
  const std::string_view prefix(name.data(), end);
  for (const BackendReg* reg : LoadedBackends()) {
    if (prefix == reg->name) return reg;
  }
  return absl::NotFoundError(fmt::format("no loaded backend made device '{}'", name));
}

std::string DescribeCudaBackend() {
  const LoadedPlugin& cuda = Plugin("cuda");
  if (!cuda.reg.ok())
    return "CUDA backend unavailable: " + std::string(cuda.reg.status().message());
  return fmt::format("CUDA backend {} (API {}, {} device(s))", cuda.path, (*cuda.reg)->api_version,
                     (*cuda.reg)->device_count());
}

}  // namespace kvpool::kernels

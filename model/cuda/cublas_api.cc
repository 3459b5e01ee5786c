#include "model/cuda/cublas_api.h"

#include <dlfcn.h>

#include <string>

#include "fmt/format.h"

namespace kvpool::model::cuda {

absl::StatusOr<const CublasApi*> LoadCublas() {
  static const absl::StatusOr<const CublasApi*> loaded = []() -> absl::StatusOr<const CublasApi*> {
    // The major version the backend was compiled against, then whatever "libcublas.so" is.
    const std::string versioned = fmt::format("libcublas.so.{}", CUBLAS_VER_MAJOR);
    std::string errors;
    void* handle = nullptr;
    for (const std::string& name : {versioned, std::string("libcublas.so")}) {
      handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) break;
      errors += fmt::format("{}{}", errors.empty() ? "" : "; ", dlerror());
    }
    if (handle == nullptr) {
      return absl::UnavailableError(
          fmt::format("cuBLAS is needed for a model on the GPU and did not load ({}); install "
                      "it or add its directory to LD_LIBRARY_PATH",
                      errors));
    }
    auto* api = new CublasApi();  // lives as long as the process, like the library
    bool missing = false;
    auto find = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, symbol));
      missing = missing || fn == nullptr;
    };
    find(api->create, "cublasCreate_v2");
    find(api->destroy, "cublasDestroy_v2");
    find(api->set_stream, "cublasSetStream_v2");
    find(api->sgemm, "cublasSgemm_v2");
    find(api->status_string, "cublasGetStatusString");
    if (missing) {
      delete api;
      return absl::UnavailableError("the cuBLAS that loaded lacks an entry point kvpool needs");
    }
    return api;
  }();
  return loaded;
}

absl::Status CublasStatus(const CublasApi& api, cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  const std::string message = fmt::format("{}: cuBLAS error {} ({})", what,
                                          static_cast<int>(status), api.status_string(status));
  if (status == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace kvpool::model::cuda

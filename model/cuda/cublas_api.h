#pragma once

// cuBLAS, loaded on first use with dlopen. The CUDA backend library links no cuBLAS: a host
// without it still gets the CUDA device and the KV kernels, and only a model on the GPU fails,
// with an error that says what is missing.

#include <cublas_v2.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvpool::model::cuda {

struct CublasApi {
  decltype(&::cublasCreate_v2) create = nullptr;
  decltype(&::cublasDestroy_v2) destroy = nullptr;
  decltype(&::cublasSetStream_v2) set_stream = nullptr;
  decltype(&::cublasSgemm_v2) sgemm = nullptr;
  decltype(&::cublasGetStatusString) status_string = nullptr;
};

// Loaded once for the life of the process. Errors: UNAVAILABLE (library or symbol missing,
// with the loader's message).
absl::StatusOr<const CublasApi*> LoadCublas();

// OK for CUBLAS_STATUS_SUCCESS; RESOURCE_EXHAUSTED for CUBLAS_STATUS_ALLOC_FAILED; INTERNAL
// otherwise, naming `what`.
absl::Status CublasStatus(const CublasApi& api, cublasStatus_t status, const char* what);

}  // namespace kvpool::model::cuda

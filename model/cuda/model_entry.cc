// The CUDA backend's third entry point: a model on one of its devices (model/step_model.h
// reaches it through kernels::CudaBackendSymbol).

#include <cstddef>
#include <cstdio>
#include <memory>
#include <string>

#include "kernels/cuda/cuda_device.h"
#include "model/cuda/cuda_model.h"

#define KVPOOL_BACKEND_EXPORT extern "C" __attribute__((visibility("default")))

// A new CudaModel the caller owns over `device` (a device this library made), taking the weights
// out of `*weights`; or null with the absl::StatusCode in `*code` and a NUL-terminated message
// (truncated to `error_bytes`) in `error`. REQUIRES: model::CheckModel(*weights, *layout).ok().
KVPOOL_BACKEND_EXPORT kvpool::model::StepModel* kvpool_backend_create_model(
    kvpool::kernels::Device* device, kvpool::model::ModelWeights* weights,
    const kvpool::kernels::PoolLayout* layout, int* code, char* error, size_t error_bytes) {
  auto fail = [&](const absl::Status& status) -> kvpool::model::StepModel* {
    if (code != nullptr) *code = static_cast<int>(status.code());
    if (error != nullptr && error_bytes > 0) {
      std::snprintf(error, error_bytes, "%s", std::string(status.message()).c_str());
    }
    return nullptr;
  };
  auto* cuda = dynamic_cast<kvpool::kernels::cuda::CudaDevice*>(device);
  if (cuda == nullptr) {
    return fail(absl::InvalidArgumentError("the device is not one of the CUDA backend's"));
  }
  absl::StatusOr<std::unique_ptr<kvpool::model::cuda::CudaModel>> model =
      kvpool::model::cuda::CudaModel::Create(std::move(*weights), *layout, cuda->ordinal(),
                                             cuda->num_sms(), cuda->name());
  if (!model.ok()) return fail(model.status());
  return model->release();
}

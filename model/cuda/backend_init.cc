// libkvpool_cuda.so's registration (kernels/backend_api.h): the CUDA device and KV kernels
// (kernels/cuda) and the model on the GPU (this directory). kvpool_backend_init is the library's
// only exported symbol (exports.map); everything else, the static CUDA runtime
// included, stays inside it.

#include <cstdio>
#include <memory>
#include <string>

#include "kernels/backend_api.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_device.h"
#include "model/cuda/cuda_model.h"

namespace kvpool::model::cuda {
namespace {

model::StepModel* CreateModel(kernels::Device* device, ModelWeights* weights,
                              const kernels::PoolLayout* layout, kernels::BackendError* error) {
  auto fail = [&](const absl::Status& status) -> model::StepModel* {
    error->code = static_cast<int>(status.code());
    std::snprintf(error->message, sizeof(error->message), "%s",
                  std::string(status.message()).c_str());
    return nullptr;
  };
  auto* cuda = dynamic_cast<kernels::cuda::CudaDevice*>(device);
  if (cuda == nullptr) {
    return fail(absl::InvalidArgumentError("the device is not one of the CUDA backend's"));
  }
  absl::StatusOr<std::unique_ptr<CudaModel>> model = CudaModel::Create(
      std::move(*weights), *layout, cuda->ordinal(), cuda->num_sms(), cuda->name());
  if (!model.ok()) return fail(model.status());
  return model->release();
}

// No extensions yet.
void* ProcAddress(const char* /*name*/) { return nullptr; }

constexpr kernels::BackendReg kRegistration{
    .api_version = kernels::kBackendApiVersion,
    .name = "cuda",
    .device_count = kernels::cuda::BackendDeviceCount,
    .create_device = kernels::cuda::BackendCreateDevice,
    .create_model = CreateModel,
    .get_proc_address = ProcAddress,
};

}  // namespace
}  // namespace kvpool::model::cuda

extern "C" __attribute__((visibility("default"))) const kvpool::kernels::BackendReg*
kvpool_backend_init(void) {
  return &kvpool::model::cuda::kRegistration;
}

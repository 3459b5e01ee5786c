#pragma once

// What the CUDA backend's kernel tests share: the backend loaded the way production loads it
// (dlopen of libkvpool_cuda.so, then the C entry points) as a test environment, and copies to
// and from device memory. A test program registers the environment once:
//
//   ::testing::Environment* const kBackend =
//       ::testing::AddGlobalTestEnvironment(new test_util::CudaBackend);
//
// and its tests skip when CudaBackend::device() is null (no library, driver or GPU).

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fmt/format.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "kvpool/util/status_macros.h"

#ifndef KVPOOL_CUDA_BACKEND_PATH
#error "KVPOOL_CUDA_BACKEND_PATH must name libkvpool_cuda.so"
#endif

#define ASSERT_OK_AND_MOVE(lhs, expr)                        \
  auto KVPOOL_STATUS_CONCAT_(result_, __LINE__) = (expr);    \
  ASSERT_TRUE(KVPOOL_STATUS_CONCAT_(result_, __LINE__).ok()) \
      << KVPOOL_STATUS_CONCAT_(result_, __LINE__).status();  \
  lhs = std::move(KVPOOL_STATUS_CONCAT_(result_, __LINE__)).value()

namespace kvpool::kernels::test_util {

// The backend for the whole test program. The library is never unloaded (the device's code lives
// in it); the device is destroyed in TearDown, before the CUDA runtime's exit handlers run.
class CudaBackend : public ::testing::Environment {
 public:
  void SetUp() override {
    void* handle = dlopen(KVPOOL_CUDA_BACKEND_PATH, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      why_ = fmt::format("cannot load the CUDA backend: {}", dlerror());
      return;
    }
    auto count = reinterpret_cast<int (*)()>(dlsym(handle, "kvpool_backend_device_count"));
    auto create = reinterpret_cast<Device* (*)(int, char*, size_t)>(
        dlsym(handle, "kvpool_backend_create_device"));
    if (count == nullptr || create == nullptr) {
      why_ = "libkvpool_cuda.so lacks the backend entry points";
      return;
    }
    if (count() <= 0) {
      why_ = "no CUDA device (no driver or no GPU): the GPU parity tests need one";
      return;
    }
    char error[512] = {0};
    device_.reset(create(0, error, sizeof(error)));
    if (device_ == nullptr) why_ = fmt::format("CUDA device 0 did not start: {}", error);
  }
  void TearDown() override { device_.reset(); }

  static Device* device() { return device_.get(); }
  static const std::string& why() { return why_; }

 private:
  static inline std::unique_ptr<Device> device_;
  static inline std::string why_;
};

// Device memory holding a copy of `count` values at `data` (uploaded and synchronized).
template <typename T>
absl::StatusOr<std::unique_ptr<DeviceBuffer>> Upload(Device& device, const T* data, size_t count) {
  const int64_t bytes = static_cast<int64_t>(count * sizeof(T));
  KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<DeviceBuffer> buffer,
                          device.AllocateBuffer(std::max<int64_t>(bytes, 16)));
  KVPOOL_ASSIGN_OR_RETURN(Fence fence,
                          device.CopyToDevice(StreamId::kTransfer, buffer->data(), data, bytes));
  KVPOOL_RETURN_IF_ERROR(device.Synchronize(fence));
  return buffer;
}

template <typename T>
absl::StatusOr<std::unique_ptr<DeviceBuffer>> Upload(Device& device, const std::vector<T>& v) {
  return Upload(device, v.data(), v.size());
}

template <typename T>
absl::StatusOr<std::vector<T>> Download(Device& device, const void* src, size_t count) {
  std::vector<T> out(count);
  KVPOOL_ASSIGN_OR_RETURN(
      Fence fence, device.CopyToHost(StreamId::kCompute, out.data(), src, count * sizeof(T)));
  KVPOOL_RETURN_IF_ERROR(device.Synchronize(fence));
  return out;
}

}  // namespace kvpool::kernels::test_util

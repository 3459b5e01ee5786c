#pragma once

// Tests parameterised over backends, as ggml's test-backend-ops runs one case table on every
// backend: a suite is instantiated over every backend this build knows of (KnownBackends: cpu,
// then cuda), and a case whose backend did not load or sees no device skips, saying why
// (GTEST_SKIP), so the GPU cases are listed in every run and run wherever there is a GPU.
//
//   class WriteKvTest : public test_util::BackendTest<Case> {};   // device(), backend(), param()
//   TEST_P(WriteKvTest, X) { ... device() ... }
//   INSTANTIATE_TEST_SUITE_P(Shapes, WriteKvTest, test_util::OnEveryBackend(Values(...)),
//                            test_util::BackendCaseName<Case>(Name));
//
// Devices come from the registry exactly as kvpoold makes them (kernels::CreateDevice), one per
// backend for the whole test program (a GPU context is slow to create), destroyed at the end of
// the program before the CUDA runtime's exit handlers run. Also: copies to and from device
// memory, for tests that must not assume a host-visible pool.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/device.h"
#include "kvpool/util/status_macros.h"

#define ASSERT_OK_AND_MOVE(lhs, expr)                        \
  auto KVPOOL_STATUS_CONCAT_(result_, __LINE__) = (expr);    \
  ASSERT_TRUE(KVPOOL_STATUS_CONCAT_(result_, __LINE__).ok()) \
      << KVPOOL_STATUS_CONCAT_(result_, __LINE__).status();  \
  lhs = std::move(KVPOOL_STATUS_CONCAT_(result_, __LINE__)).value()

// Skips the test, saying why, when `status` says `backend` is unavailable here (fails it instead
// under KVPOOL_REQUIRE_GPU=1 for a backend other than the CPU).
#define KVPOOL_SKIP_UNAVAILABLE(backend, status)                                             \
  if ((status).code() == ::absl::StatusCode::kUnavailable) {                                 \
    if (::kvpool::kernels::test_util::RequireGpu() && (backend) != "cpu") {                  \
      FAIL() << (backend) << " backend unavailable with KVPOOL_REQUIRE_GPU=1: " << (status); \
    }                                                                                        \
    GTEST_SKIP() << (backend) << " backend unavailable: " << (status).message();             \
  }

namespace kvpool::kernels::test_util {

inline std::vector<std::string> BackendNames() {
  std::vector<std::string> out;
  for (std::string_view name : KnownBackends()) out.emplace_back(name);
  return out;
}

inline auto AllBackends() { return ::testing::ValuesIn(BackendNames()); }

// Every backend, each with every case of `cases`.
template <typename Cases>
auto OnEveryBackend(Cases cases) {
  return ::testing::Combine(AllBackends(), cases);
}

struct BackendName {
  std::string operator()(const ::testing::TestParamInfo<std::string>& info) const {
    return info.param;
  }
};

// "<backend>_<the case's own name>".
template <typename Case, typename CaseName>
auto BackendCaseName(CaseName case_name) {
  return [case_name](const ::testing::TestParamInfo<std::tuple<std::string, Case>>& info) {
    return std::get<0>(info.param) + "_" +
           case_name(::testing::TestParamInfo<Case>(std::get<1>(info.param), info.index));
  };
}

inline BackendKind KindOf(std::string_view backend) {
  absl::StatusOr<BackendKind> kind = ParseBackend(backend);
  return kind.ok() ? *kind : BackendKind::kCpu;
}

// One device per backend for the test program, made on first use.
class Devices : public ::testing::Environment {
 public:
  // Device 0 of `backend` (2 kernel threads on the CPU), or why there is none: UNAVAILABLE when
  // the backend did not load or sees no device; other codes are failures of a present device.
  static absl::StatusOr<Device*> Get(const std::string& backend) {
    auto it = devices().find(backend);
    if (it == devices().end()) {
      it = devices()
               .emplace(backend, CreateDevice({.kind = KindOf(backend), .cpu_threads = 2}))
               .first;
    }
    if (!it->second.ok()) return it->second.status();
    return it->second->get();
  }
  void TearDown() override { devices().clear(); }

 private:
  static std::map<std::string, absl::StatusOr<std::unique_ptr<Device>>>& devices() {
    static auto* all = new std::map<std::string, absl::StatusOr<std::unique_ptr<Device>>>;
    return *all;
  }
};

inline ::testing::Environment* const kDevices = ::testing::AddGlobalTestEnvironment(new Devices);

// Where a GPU must be present (bench/gpu_check.sh sets KVPOOL_REQUIRE_GPU=1), an unavailable
// non-CPU backend fails its cases instead of skipping them.
inline bool RequireGpu() {
  const char* v = std::getenv("KVPOOL_REQUIRE_GPU");
  return v != nullptr && std::string_view(v) == "1";
}

// A fixture on one backend's device: the parameter is (backend, Case), or the backend alone when
// Case is void. Skips, saying why, when the backend is unavailable here.
template <typename Case = void>
class BackendTest
    : public ::testing::TestWithParam<
          std::conditional_t<std::is_void_v<Case>, std::string, std::tuple<std::string, Case>>> {
 protected:
  void SetUp() override {
    absl::StatusOr<Device*> device = Devices::Get(backend());
    KVPOOL_SKIP_UNAVAILABLE(backend(), device.status());
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *device;
  }
  const std::string& backend() const {
    if constexpr (std::is_void_v<Case>) {
      return this->GetParam();
    } else {
      return std::get<0>(this->GetParam());
    }
  }
  template <typename C = Case>
  const C& param() const {
    return std::get<1>(this->GetParam());
  }
  Device& device() { return *device_; }

 private:
  Device* device_ = nullptr;
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

// The backend registry (kernels/backend.h, backend_api.h): the built-in CPU backend, plug-ins
// loaded through their one entry point, and the refusals a stale or foreign library gets. The
// plug-ins here are fake_backend.cc built several ways (CMakeLists.txt passes their paths).

#include <cstdlib>
#include <string>

#include "fmt/format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace kvpool::kernels {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(BackendRegistryTest, TheCpuBackendIsBuiltInAndFirst) {
  const std::vector<const BackendReg*> loaded = LoadedBackends();
  ASSERT_FALSE(loaded.empty());
  EXPECT_EQ(loaded.front(), &CpuBackend());
  EXPECT_STREQ(CpuBackend().name, "cpu");
  EXPECT_EQ(CpuBackend().api_version, kBackendApiVersion);
  EXPECT_EQ(CpuBackend().device_count(), 1);
  EXPECT_EQ(CpuBackend().create_model, nullptr);  // the host model runs over its pools
  absl::StatusOr<std::unique_ptr<Device>> device =
      CreateDevice({.kind = BackendKind::kCpu, .cpu_threads = 1});
  ASSERT_TRUE(device.ok()) << device.status();
  absl::StatusOr<const BackendReg*> made_by = BackendOf(**device);
  ASSERT_TRUE(made_by.ok()) << made_by.status();
  EXPECT_EQ(*made_by, &CpuBackend());
}

TEST(BackendRegistryTest, LoadsAPluginAndItsExtensions) {
  absl::StatusOr<const BackendReg*> reg = LoadBackendLibrary(KVPOOL_FAKE_BACKEND);
  ASSERT_TRUE(reg.ok()) << reg.status();
  EXPECT_STREQ((*reg)->name, "fake");
  EXPECT_EQ((*reg)->api_version, kBackendApiVersion);
  EXPECT_EQ((*reg)->device_count(), 0);
  auto answer = reinterpret_cast<int (*)()>((*reg)->get_proc_address("kvpool_fake_answer"));
  ASSERT_NE(answer, nullptr);
  EXPECT_EQ(answer(), 42);
  EXPECT_EQ((*reg)->get_proc_address("kvpool_no_such_thing"), nullptr);
  const DeviceParams params;
  BackendError error;
  EXPECT_EQ((*reg)->create_device(&params, &error), nullptr);
  EXPECT_STREQ(error.message, "the fake backend has no devices");
}

TEST(BackendRegistryTest, APluginOfAnotherApiVersionIsRefusedNamingBoth) {
  absl::StatusOr<const BackendReg*> reg = LoadBackendLibrary(KVPOOL_STALE_BACKEND);
  ASSERT_EQ(reg.status().code(), absl::StatusCode::kFailedPrecondition) << reg.status();
  EXPECT_THAT(reg.status().message(),
              HasSubstr(fmt::format("built for kvpool backend API {}, this program speaks {}",
                                    kBackendApiVersion + 1, kBackendApiVersion)));
}

TEST(BackendRegistryTest, ALibraryWithoutTheEntryPointIsNotABackend) {
  absl::StatusOr<const BackendReg*> reg = LoadBackendLibrary(KVPOOL_NO_INIT_BACKEND);
  ASSERT_EQ(reg.status().code(), absl::StatusCode::kNotFound) << reg.status();
  EXPECT_THAT(reg.status().message(), HasSubstr("not a kvpool backend (no kvpool_backend_init)"));
}

TEST(BackendRegistryTest, AnIncompleteRegistrationIsRefused) {
  absl::StatusOr<const BackendReg*> reg = LoadBackendLibrary(KVPOOL_INCOMPLETE_BACKEND);
  ASSERT_EQ(reg.status().code(), absl::StatusCode::kFailedPrecondition) << reg.status();
  EXPECT_THAT(reg.status().message(), HasSubstr("incomplete backend registration"));
}

TEST(BackendRegistryTest, AMissingLibraryIsNotFound) {
  EXPECT_EQ(LoadBackendLibrary("/nonexistent/libkvpool_nothing.so").status().code(),
            absl::StatusCode::kNotFound);
}

TEST(BackendRegistryTest, AutoFallsBackToTheCpuWhenCudaIsUnavailable) {
  absl::StatusOr<const BackendReg*> cuda = PluginBackend("cuda");
  if (cuda.ok() && (*cuda)->device_count() > 0) {
    GTEST_SKIP() << "a CUDA device is present: " << DescribeCudaBackend();
  }
  absl::StatusOr<std::unique_ptr<Device>> device =
      CreateDevice({.kind = BackendKind::kAuto, .cpu_threads = 1});
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_THAT((*device)->name(), StartsWith("cpu"));
  EXPECT_EQ(CreateDevice({.kind = BackendKind::kCuda}).status().code(),
            absl::StatusCode::kUnavailable);
}

// Run by ctest with KVPOOL_BACKEND_DIR naming a directory whose libkvpool_cuda.so is the stale
// fake (backend_fallback_test): the daemon's `auto` falls back to the CPU and `cuda` is refused
// with the version in the message, even where a good copy sits further down the search path.
TEST(BackendRegistryTest, AStalePluginFirstOnThePathIsAnErrorNotMasked) {
  const char* dir = std::getenv("KVPOOL_BACKEND_DIR");
  if (dir == nullptr) GTEST_SKIP() << "run as backend_fallback_test (KVPOOL_BACKEND_DIR set)";
  absl::StatusOr<std::unique_ptr<Device>> cuda = CreateDevice({.kind = BackendKind::kCuda});
  ASSERT_EQ(cuda.status().code(), absl::StatusCode::kUnavailable) << cuda.status();
  EXPECT_THAT(cuda.status().message(), HasSubstr("built for kvpool backend API"));
  EXPECT_THAT(DescribeCudaBackend(), HasSubstr("built for kvpool backend API"));
  absl::StatusOr<std::unique_ptr<Device>> device =
      CreateDevice({.kind = BackendKind::kAuto, .cpu_threads = 1});
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_THAT((*device)->name(), StartsWith("cpu"));
  EXPECT_EQ(LoadedBackends().size(), 1u);
}

}  // namespace
}  // namespace kvpool::kernels

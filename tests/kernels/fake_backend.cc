// A backend plug-in for backend_registry_test, built several ways (tests/kernels/CMakeLists.txt):
//   FAKE_BACKEND_NEWER    register this tree's api_version + 1 (a plug-in from another tree)
//   FAKE_BACKEND_NO_INIT  export no kvpool_backend_init at all
//   FAKE_BACKEND_NAME     the name it registers (default "fake")
//   FAKE_BACKEND_INCOMPLETE  leave create_device null
// It has no devices; get_proc_address knows one extension, "kvpool_fake_answer".

#include <cstring>

#include "kernels/backend_api.h"

#ifdef FAKE_BACKEND_NEWER
#define FAKE_BACKEND_VERSION (kvpool::kernels::kBackendApiVersion + 1)
#else
#define FAKE_BACKEND_VERSION kvpool::kernels::kBackendApiVersion
#endif
#ifndef FAKE_BACKEND_NAME
#define FAKE_BACKEND_NAME "fake"
#endif

namespace {

using kvpool::kernels::BackendError;
using kvpool::kernels::BackendReg;
using kvpool::kernels::Device;
using kvpool::kernels::DeviceParams;

int DeviceCount() { return 0; }

[[maybe_unused]] Device* CreateDevice(const DeviceParams* /*params*/, BackendError* error) {
  error->code = 9;  // FAILED_PRECONDITION
  std::strncpy(error->message, "the fake backend has no devices", sizeof(error->message) - 1);
  return nullptr;
}

int Answer() { return 42; }

void* ProcAddress(const char* name) {
  return std::strcmp(name, "kvpool_fake_answer") == 0 ? reinterpret_cast<void*>(&Answer) : nullptr;
}

const BackendReg kRegistration{
    .api_version = FAKE_BACKEND_VERSION,
    .name = FAKE_BACKEND_NAME,
    .device_count = DeviceCount,
#ifdef FAKE_BACKEND_INCOMPLETE
    .create_device = nullptr,
#else
    .create_device = CreateDevice,
#endif
    .create_model = nullptr,
    .get_proc_address = ProcAddress,
};

}  // namespace

#ifndef FAKE_BACKEND_NO_INIT
extern "C" __attribute__((visibility("default"))) const BackendReg* kvpool_backend_init(void) {
  return &kRegistration;
}
#else
// Something exported, so the library is a plausible plug-in that merely lacks the entry point.
extern "C" __attribute__((visibility("default"))) const BackendReg* kvpool_backend_init_v0(void) {
  return &kRegistration;
}
#endif

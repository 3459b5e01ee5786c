#pragma once

// Abseil's mutex deadlock detection, decided once per program in its main() and never by a
// library (a library cannot know whether its host is a test that relies on the check).
//
// Debian's Abseil is built without NDEBUG, so by default every absl::Mutex acquisition, gRPC's
// own locks included, updates a global lock-order graph: a cost on every lock of every RPC. A
// release program turns the check off; debug builds and every test (tests/test_main.cc) abort
// on a lock-order cycle instead.

#include "absl/synchronization/mutex.h"

namespace kvpool {

// Call first thing in main(): off under NDEBUG, abort on a cycle otherwise.
inline void SetProgramDeadlockDetection() {
#ifdef NDEBUG
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#else
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kAbort);
#endif
}

}  // namespace kvpool

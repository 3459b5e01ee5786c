// The main() of every kvpool test: GoogleTest's, with Abseil's mutex deadlock detection set to
// abort, so a lock-order cycle any test takes fails it at once (kvpoold turns the detection off
// in release builds: it costs on every lock).

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

int main(int argc, char** argv) {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kAbort);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

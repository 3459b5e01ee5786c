#pragma once

// SignalWatcher: SIGTERM and SIGINT for kvpoold (STYLE.md, "Daemon"). Install() blocks both in
// the calling thread, so every thread started afterwards inherits the mask, and starts a sigwait
// thread that takes them: the first signal runs the handler (once one is set), a second one
// exits the process at once. Threads that libraries started before main() (OpenBLAS starts its
// pool in a constructor) do not block them; a handler forwards what lands there to the sigwait
// thread.
//
// Thread-safe. One per process; lives until the process exits.

#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvpool::daemon {

class SignalWatcher final {
 public:
  // REQUIRES: called from the main thread before it starts any thread.
  static SignalWatcher& Install();

  // Runs `handler` on the first signal (at once, on this thread, if one came already).
  void OnFirstSignal(std::function<void()> handler);

 private:
  SignalWatcher() = default;
  void Loop();

  absl::Mutex mu_;
  std::function<void()> handler_ ABSL_GUARDED_BY(mu_);
  bool signalled_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvpool::daemon

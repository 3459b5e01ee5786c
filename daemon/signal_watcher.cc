#include "daemon/signal_watcher.h"

#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <thread>

#include "absl/synchronization/notification.h"
#include "kvpool/util/logging.h"

namespace kvpool::daemon {
namespace {

// The sigwait thread's id, for ForwardSignal.
std::atomic<pid_t> g_signal_thread{0};

// Runs on a thread that does not block SIGTERM/SIGINT (a library's): hands the signal to the
// sigwait thread, which blocks it, so it waits there for sigwait. tgkill is a plain system call
// (async-signal-safe).
extern "C" void ForwardSignal(int sig) {
  const pid_t tid = g_signal_thread.load();
  if (tid != 0) syscall(SYS_tgkill, getpid(), tid, sig);
}

sigset_t Signals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  return signals;
}

}  // namespace

SignalWatcher& SignalWatcher::Install() {
  static SignalWatcher* const watcher = [] {
    const sigset_t signals = Signals();
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    auto* w = new SignalWatcher();
    absl::Notification started;
    std::thread([w, &started] {
      g_signal_thread.store(static_cast<pid_t>(syscall(SYS_gettid)));
      started.Notify();
      w->Loop();
    }).detach();  // lives until the process exits (it may force that exit)
    started.WaitForNotification();
    struct sigaction forward = {};
    forward.sa_handler = ForwardSignal;
    sigaction(SIGTERM, &forward, nullptr);
    sigaction(SIGINT, &forward, nullptr);
    return w;
  }();
  return *watcher;
}

void SignalWatcher::OnFirstSignal(std::function<void()> handler) {
  bool now;
  {
    absl::MutexLock lock(&mu_);
    handler_ = handler;
    now = signalled_;
  }
  if (now) handler();
}

void SignalWatcher::Loop() {
  const sigset_t signals = Signals();
  bool first = true;
  for (;;) {
    int sig = 0;
    if (sigwait(&signals, &sig) != 0) continue;
    if (!first) {
      std::fprintf(stderr, "kvpoold: second signal: exiting now\n");
      _exit(1);
    }
    first = false;
    Logger("daemon").info("signal {}: shutting down (send it again to force)", sig);
    std::function<void()> handler;
    {
      absl::MutexLock lock(&mu_);
      signalled_ = true;
      handler = handler_;
    }
    if (handler) handler();
  }
}

}  // namespace kvpool::daemon

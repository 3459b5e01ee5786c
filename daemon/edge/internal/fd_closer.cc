#include "daemon/edge/internal/fd_closer.h"

#include <chrono>
#include <utility>

#include "kvpool/util/logging.h"

namespace kvpool::daemon {

FdCloser::FdCloser() : thread_([this] { Run(); }) {}

FdCloser::~FdCloser() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

void FdCloser::Close(UniqueFd fd) {
  if (!fd.valid()) return;
  size_t backlog;
  {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(fd));
    backlog = queue_.size();
  }
  if (backlog >= kLoggedBacklog && (backlog & (backlog - 1)) == 0) {
    Logger("daemon").warn(
        "fd closer: {} descriptors wait to be closed (a close that blocks holds them up)", backlog);
  }
}

size_t FdCloser::pending() const {
  absl::MutexLock lock(&mu_);
  return queue_.size() + (closing_ ? 1 : 0);
}

void FdCloser::Run() {
  for (;;) {
    UniqueFd fd;
    {
      absl::MutexLock lock(&mu_, absl::Condition(this, &FdCloser::HasWork));
      closing_ = false;
      if (queue_.empty()) return;  // stopping, and everything is closed
      fd = std::move(queue_.front());
      queue_.pop_front();
      closing_ = true;
    }
    // May block for as long as the file's owner likes: nothing is held. Timed for the log only.
    const auto start = std::chrono::steady_clock::now();
    fd.reset();
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
    if (took > std::chrono::seconds(1)) {
      Logger("daemon").warn("fd closer: a close took {:.1f} s", took.count());
    }
  }
}

}  // namespace kvpool::daemon

#pragma once

// FdCloser: closes descriptors on a thread of its own, for a thread that must never wait on a
// close() (the attach loop, daemon/edge/attach_server.h, on kernels without SO_PASSRIGHTS).
//
// The last close of a file can block for as long as whoever controls the file likes: a TCP
// socket with SO_LINGER whose send queue cannot drain waits out its linger, a FUSE file's flush
// waits for its FUSE server. Closing a Unix socket also drops the descriptors still queued in it,
// and the kernel runs their last close on the closing thread before the close returns. A peer
// that hands its server such a file and closes its own copy therefore chooses how long the
// server's close takes.
//
// Close() only queues (under a lock held for a push): it never waits for a close. The thread
// closes in order, one at a time, so a close that blocks holds up every one queued behind it:
// those descriptors stay open, counted against the process's descriptor limit, until it returns
// (which may be never: a FUSE server that never answers). The queue has no bound of its own; the
// descriptor limit bounds it. A close over a second is logged when it returns, and a backlog of
// kLoggedBacklog, twice that, four times ... as it is reached.
// The destructor closes what is queued and joins the thread: it waits out a close that blocks.
//
// Thread-safe.

#include <cstddef>
#include <deque>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvpool/util/unique_fd.h"

namespace kvpool::daemon {

struct LockOrderPeer;

class FdCloser final {
 public:
  FdCloser();
  ~FdCloser();
  FdCloser(const FdCloser&) = delete;
  FdCloser& operator=(const FdCloser&) = delete;

  // Queues `fd` (empty: nothing) to be closed on the closer's thread; returns at once.
  void Close(UniqueFd fd);
  // Descriptors queued or being closed.
  size_t pending() const;

  static constexpr size_t kLoggedBacklog = 1024;  // a burst of closes stays below it

 private:
  friend struct LockOrderPeer;  // tests/daemon/lock_order_test.cc: mu_ is a leaf
  void Run();
  bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); }

  mutable absl::Mutex mu_;
  std::deque<UniqueFd> queue_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;  // the thread is in a close()
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvpool::daemon

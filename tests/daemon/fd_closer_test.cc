// FdCloser: Close() never waits for a close, even behind one that blocks; what is queued behind
// such a close waits for it (the cost the attach server's header states); the destructor closes
// everything queued.

#include "daemon/edge/internal/fd_closer.h"

#include <poll.h>
#include <unistd.h>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/daemon/lingering_socket.h"

namespace kvpool::daemon {
namespace {

// A pipe: the closer gets the read end; the write end tells when no copy of it is left.
struct Pipe {
  Pipe() {
    int fds[2];
    EXPECT_EQ(pipe(fds), 0);
    read_end.reset(fds[0]);
    write_end.reset(fds[1]);
  }
  // Whether the read end was closed within `timeout_ms`.
  bool ReadEndClosed(int timeout_ms) {
    pollfd p{write_end.get(), 0, 0};
    return poll(&p, 1, timeout_ms) == 1 && (p.revents & POLLERR) != 0;
  }
  UniqueFd read_end, write_end;
};

TEST(FdCloserTest, ClosesWhatItIsGiven) {
  FdCloser closer;
  Pipe pipe;
  closer.Close(std::move(pipe.read_end));
  EXPECT_TRUE(pipe.ReadEndClosed(5000));
  closer.Close(UniqueFd());  // nothing
}

TEST(FdCloserTest, ACloseThatBlocksHoldsUpOnlyTheClosesBehindIt) {
  LingeringSocket lingering;
  if (absl::Status s = lingering.Open(absl::Seconds(20)); !s.ok()) GTEST_SKIP() << s;
  FdCloser closer;
  Pipe behind;
  const absl::Time start = absl::Now();
  closer.Close(lingering.TakeSocket());  // the last copy: its close lingers
  closer.Close(std::move(behind.read_end));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // neither Close() waited
  EXPECT_FALSE(behind.ReadEndClosed(100));           // queued behind the lingering close
  EXPECT_GE(closer.pending(), 1u);
  lingering.EndTheLinger();
  EXPECT_TRUE(behind.ReadEndClosed(5000));
}

TEST(FdCloserTest, TheDestructorClosesEverythingQueued) {
  std::vector<Pipe> pipes(16);
  {
    FdCloser closer;
    for (Pipe& p : pipes) closer.Close(std::move(p.read_end));
  }
  for (Pipe& p : pipes) EXPECT_TRUE(p.ReadEndClosed(0));
}

}  // namespace
}  // namespace kvpool::daemon

#pragma once

// FakeRedisServer: a scripted stand-in for a Redis node, for what a real redis-server will not
// do on request: answer a byte at a time, redirect to an address of the test's choosing, or
// record what a client sent it. Listens on 127.0.0.1 at a port the kernel picks; every accepted
// connection gets a thread of its own running the test's handler. Used by tests/tier only.
//
// Thread-safe: the handler runs on the server's threads; accepted() and commands() may be read
// from the test's thread at any time. The destructor stops accepting, shuts every connection
// down (a handler blocked in ReadCommand returns nullopt, one waiting in Pause returns false)
// and joins every thread.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvpool::tier::testing {

class FakeRedisServer;

// One accepted connection, as its handler sees it.
class FakeConnection final {
 public:
  FakeConnection(FakeRedisServer* server, int fd) : server_(server), fd_(fd) {}

  // The next request (a RESP array of bulk strings, as hiredis sends every command), recorded
  // in the server's commands(); nullopt when the peer closed, sent something else, or the
  // server is stopping.
  std::optional<std::vector<std::string>> ReadCommand();
  // Writes all of `bytes`. False when the peer is gone or the server is stopping.
  bool Write(std::string_view bytes);
  // Waits `how_long` (the pace of a slow server: the one sleep a fake server needs). False when
  // the server began stopping meanwhile.
  bool Pause(absl::Duration how_long);
  // Hangs up (the peer reads EOF); the descriptor is closed with the server.
  void HangUp();

 private:
  bool Fill();  // reads more bytes into buffer_; false on EOF or error
  std::optional<std::string> Line();
  FakeRedisServer* const server_;
  const int fd_;
  std::string buffer_;
};

class FakeRedisServer final {
 public:
  using Handler = std::function<void(FakeConnection&)>;
  // Errors: INTERNAL when it cannot listen.
  static absl::StatusOr<std::unique_ptr<FakeRedisServer>> Start(Handler handler);
  ~FakeRedisServer();
  FakeRedisServer(const FakeRedisServer&) = delete;
  FakeRedisServer& operator=(const FakeRedisServer&) = delete;

  int port() const { return port_; }
  std::string address() const;  // "127.0.0.1:<port>"
  int accepted() const { return accepted_.load(); }
  // Every command any connection sent so far, in arrival order.
  std::vector<std::vector<std::string>> commands() const;

 private:
  friend class FakeConnection;
  FakeRedisServer(int listen_fd, int port, Handler handler)
      : listen_fd_(listen_fd), port_(port), handler_(std::move(handler)) {}
  void AcceptLoop();
  bool stopping() const;
  void Record(std::vector<std::string> command);

  const int listen_fd_;
  const int port_;
  const Handler handler_;
  std::atomic<int> accepted_{0};
  std::thread acceptor_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<int> fds_ ABSL_GUARDED_BY(mu_);  // accepted connections, closed at destruction
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<std::string>> commands_ ABSL_GUARDED_BY(mu_);
};

// RESP encodings for handlers.
std::string RespBulk(std::string_view s);
std::string RespError(std::string_view text);  // "-<text>\r\n"
// A CLUSTER SLOTS answer: every slot served by 127.0.0.1:`port`.
std::string RespAllSlotsOn(int port);

}  // namespace kvpool::tier::testing

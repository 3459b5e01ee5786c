#pragma once

// Tests only: a descriptor whose last close() blocks, as a hostile peer would hand one to the
// daemon (attach_server_test.cc, fd_closer_test.cc).

#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "kvpool/util/unique_fd.h"

namespace kvpool::daemon {

// A descriptor whose last close() blocks for as long as its linger: a TCP socket connected to a
// 127.0.0.1 listener that never accepts, so the small receive window stays shut and the socket's
// full send queue never drains; with SO_LINGER {1, linger} close() waits for that queue. A peer
// that hands one to the daemon and closes its own copy leaves the daemon the close. Destroying it
// closes the listener first: the reset ends such a close at once, wherever it is waiting.
class LingeringSocket {
 public:
  LingeringSocket() = default;
  LingeringSocket(const LingeringSocket&) = delete;
  LingeringSocket& operator=(const LingeringSocket&) = delete;
  ~LingeringSocket() {
    listener_.reset();
    socket_.reset();
  }

  // UNAVAILABLE: no TCP loopback here; INTERNAL: the send queue would not fill.
  absl::Status Open(absl::Duration linger_time) {
    listener_.reset(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!listener_.valid()) return Unavailable("socket(AF_INET)");
    const int small = 4096;  // the queued connection inherits it: a window of a few KiB
    setsockopt(listener_.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (bind(listener_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(listener_.get(), 1) != 0 ||
        getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return Unavailable("bind/listen 127.0.0.1:0");
    }
    socket_.reset(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    setsockopt(socket_.get(), SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    if (connect(socket_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      return Unavailable("connect 127.0.0.1");
    }
    fcntl(socket_.get(), F_SETFL, fcntl(socket_.get(), F_GETFL) | O_NONBLOCK);
    static char chunk[1 << 16];
    bool full = false;
    for (int i = 0; i < 10000 && !full; ++i) {
      full = send(socket_.get(), chunk, sizeof(chunk), MSG_NOSIGNAL) < 0 && errno == EAGAIN;
    }
    if (!full) return absl::InternalError("the send queue did not fill");
    const ::linger l{1, static_cast<int>(absl::ToInt64Seconds(linger_time))};
    if (setsockopt(socket_.get(), SOL_SOCKET, SO_LINGER, &l, sizeof(l)) != 0) {
      return absl::InternalError(std::strerror(errno));
    }
    return absl::OkStatus();
  }
  int fd() const { return socket_.get(); }
  // Closes this copy, which must not be the last (one is in flight): it does not block.
  void CloseOwnCopy() { socket_.reset(); }
  // Gives the socket away: whoever closes it makes the last close.
  UniqueFd TakeSocket() { return std::move(socket_); }
  // Resets the connection: a close waiting on it returns.
  void EndTheLinger() { listener_.reset(); }

 private:
  static absl::Status Unavailable(const char* what) {
    return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
  }
  UniqueFd listener_, socket_;
};

}  // namespace kvpool::daemon

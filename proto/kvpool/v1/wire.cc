#include "kvpool/v1/wire.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvpool::wire {
namespace {

// A peer that hung up is UNAVAILABLE, like a clean close; any other failure is INTERNAL.
absl::Status Errno(const char* what) {
  const std::string message = std::string(what) + ": " + std::strerror(errno);
  if (errno == EPIPE || errno == ECONNRESET) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

// Waits until `socket` is readable or `deadline` passes.
absl::Status WaitReadable(int socket, absl::Time deadline) {
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("attach socket timed out");
    pollfd p{socket, POLLIN, 0};
    const int n = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1);
    if (n > 0) return absl::OkStatus();
    if (n < 0 && errno != EINTR) return Errno("poll");
  }
}

void CollectFds(msghdr* msg, std::vector<int>* fds) {
  for (cmsghdr* c = CMSG_FIRSTHDR(msg); c != nullptr; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const int* data = reinterpret_cast<const int*>(CMSG_DATA(c));
    for (size_t i = 0; i < n; ++i) {
      if (fds != nullptr) {
        fds->push_back(data[i]);
      } else {
        close(data[i]);
      }
    }
  }
}

}  // namespace

std::string DefaultRuntimeDir() {
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && xdg[0] != '\0') {
    return std::string(xdg) + "/kvpool";
  }
  return "/tmp/kvpool-" + std::to_string(getuid());
}

absl::Status SendFrame(int socket, const google::protobuf::MessageLite& message,
                       const std::vector<int>& fds) {
  std::string body;
  if (!message.SerializeToString(&body)) return absl::InternalError("cannot serialize frame");
  if (body.size() > kMaxFrameBytes) return absl::InvalidArgumentError("frame too large");
  if (fds.size() > static_cast<size_t>(kMaxFds)) return absl::InvalidArgumentError("too many fds");
  const uint32_t n = static_cast<uint32_t>(body.size());
  std::string frame(4, '\0');
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  frame += body;

  size_t sent = 0;
  bool fds_sent = fds.empty();
  while (sent < frame.size()) {
    iovec iov{frame.data() + sent, frame.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
    if (!fds_sent) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
      std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    const ssize_t n_sent = sendmsg(socket, &msg, MSG_NOSIGNAL);
    if (n_sent < 0) {
      if (errno == EINTR) continue;
      return Errno("sendmsg");
    }
    fds_sent = true;
    sent += static_cast<size_t>(n_sent);
  }
  return absl::OkStatus();
}

absl::Status FrameReader::Append(std::string_view bytes) {
  if (failed_ || bytes.size() > wanted()) {
    failed_ = true;
    return absl::InvalidArgumentError("attach frame longer than it announced");
  }
  buffer_.append(bytes);
  if (!have_length_ && buffer_.size() == 4) {
    uint32_t length = 0;
    for (int i = 0; i < 4; ++i) {
      length |= static_cast<uint32_t>(static_cast<uint8_t>(buffer_[i])) << (8 * i);
    }
    if (length > max_bytes_) {
      failed_ = true;
      return absl::InvalidArgumentError(
          absl::StrCat("attach frame of ", length, " bytes (at most ", max_bytes_, ")"));
    }
    want_ = 4 + length;
    have_length_ = true;
  }
  return absl::OkStatus();
}

absl::Status FrameReader::Parse(google::protobuf::MessageLite* message) const {
  if (!complete()) return absl::FailedPreconditionError("attach frame incomplete");
  if (!message->ParseFromArray(buffer_.data() + 4, static_cast<int>(buffer_.size() - 4))) {
    return absl::InvalidArgumentError("unparsable attach frame");
  }
  return absl::OkStatus();
}

absl::Status ReceiveFrame(int socket, google::protobuf::MessageLite* message, std::vector<int>* fds,
                          absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  FrameReader reader;
  while (!reader.complete()) {
    if (absl::Status s = WaitReadable(socket, deadline); !s.ok()) return s;
    char chunk[4096];
    iovec iov{chunk, std::min(sizeof(chunk), reader.wanted())};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return Errno("recvmsg");
    }
    CollectFds(&msg, fds);
    if (n == 0) return absl::UnavailableError("the peer closed the attach socket");
    if (absl::Status s = reader.Append({chunk, static_cast<size_t>(n)}); !s.ok()) return s;
  }
  return reader.Parse(message);
}

}  // namespace kvpool::wire

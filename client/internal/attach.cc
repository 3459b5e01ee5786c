#include "client/internal/attach.h"

#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "fmt/format.h"
#include "kvpool/v1/runtime_dir.h"
#include "kvpool/v1/wire.h"

namespace kvpool::client::internal {
namespace {

absl::StatusOr<UniqueFd> ConnectSocket(const std::string& path, absl::Duration timeout) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(fmt::format("attach socket path {} is longer than {} bytes",
                                                  path, sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);

  UniqueFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    return absl::InternalError(fmt::format("socket(AF_UNIX): {}", std::strerror(errno)));
  }
  // On Unix sockets the send timeout also bounds a connect() that waits on a full backlog.
  const timeval tv = absl::ToTimeval(timeout);
  setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));

  int rc;
  do {
    rc = connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return fd;
  const int err = errno;
  const std::string why = fmt::format("connect {}: {}", path, std::strerror(err));
  switch (err) {
    case ENOENT:
    case ECONNREFUSED:
    case ENOTDIR:
      return absl::UnavailableError(
          fmt::format("no kvpoold listening at {} ({})", path, std::strerror(err)));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(why);
    case EAGAIN:
    case ETIMEDOUT:
      return absl::DeadlineExceededError(why);
    default:
      return absl::UnavailableError(why);
  }
}

absl::StatusCode RefusalCode(int32_t code) {
  if (code <= 0 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::StatusCode::kUnknown;
  }
  return static_cast<absl::StatusCode>(code);
}

}  // namespace

absl::StatusOr<Attachment> Attach(const std::string& runtime_dir, const v1::AttachRequest& request,
                                  absl::Duration timeout, std::span<const uid_t> trusted) {
  const std::string path = runtime_dir + "/" + wire::kAttachSocket;
  absl::StatusOr<uid_t> daemon_uid = wire::TrustedDaemonUid(runtime_dir, trusted);
  if (!daemon_uid.ok()) return daemon_uid.status();
  absl::StatusOr<UniqueFd> socket = ConnectSocket(path, timeout);
  if (!socket.ok()) return socket.status();
  // Who listens: SO_PEERCRED reports the credentials the listener had when it called listen().
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(socket->get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return absl::InternalError(fmt::format("SO_PEERCRED on {}: {}", path, std::strerror(errno)));
  }
  if (cred.uid != *daemon_uid && cred.uid != 0) {
    return absl::PermissionDeniedError(
        fmt::format("the listener at {} runs as uid {} (pid {}), not as the runtime directory's "
                    "owner {}: not sending it anything",
                    path, cred.uid, cred.pid, *daemon_uid));
  }

  return Exchange(std::move(*socket), path, request, timeout);
}

absl::StatusOr<Attachment> Exchange(UniqueFd socket, const std::string& path,
                                    const v1::AttachRequest& request, absl::Duration timeout) {
  Attachment out;
  out.socket = std::move(socket);
  // A daemon that refuses a peer at accept writes its refusal and hangs up, often before our
  // request is sent: the send then fails with EPIPE while the refusal waits to be read.
  const absl::Status sent = wire::SendFrame(out.socket.get(), request);
  if (!sent.ok() && sent.code() != absl::StatusCode::kUnavailable) {
    return absl::Status(sent.code(), fmt::format("sending the attach request to {}: {}", path,
                                                 std::string(sent.message())));
  }
  std::vector<int> raw_fds;
  const absl::Status received =
      wire::ReceiveFrame(out.socket.get(), &out.response, &raw_fds, timeout);
  for (int fd : raw_fds) out.fds.emplace_back(fd);  // owned (and closed) whatever happens next
  if (!received.ok()) {
    if (received.code() == absl::StatusCode::kUnavailable) {
      return absl::UnavailableError(
          fmt::format("kvpoold at {} closed the connection without answering the attach", path));
    }
    return absl::Status(received.code(),
                        fmt::format("attaching to {}: {}", path, std::string(received.message())));
  }
  if (!out.response.error().empty()) {
    return absl::Status(
        RefusalCode(out.response.error_code()),
        fmt::format("kvpoold at {} refused the attach: {}", path, out.response.error()));
  }
  if (!sent.ok()) {
    // An answer that is not a refusal to a request the daemon never got: not to be trusted.
    return absl::UnavailableError(
        fmt::format("kvpoold at {} hung up before the attach request was sent: {}", path,
                    std::string(sent.message())));
  }
  return out;
}

}  // namespace kvpool::client::internal

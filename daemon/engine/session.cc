#include "daemon/engine/session.h"

#include <sys/random.h>

#include <cerrno>

#include "fmt/format.h"
#include "kvpool/util/check.h"

namespace kvpool::daemon {

std::string_view SessionEndName(SessionEnd how) {
  switch (how) {
    case SessionEnd::kDetached:
      return "detached";
    case SessionEnd::kConnectionLost:
      return "connection lost";
    case SessionEnd::kShutdown:
      return "shutdown";
  }
  return "?";
}

std::string NewToken() {
  uint64_t bits[2];
  size_t got = 0;
  while (got < sizeof(bits)) {
    const ssize_t n = getrandom(reinterpret_cast<char*>(bits) + got, sizeof(bits) - got, 0);
    KVPOOL_CHECK_MSG(n > 0 || errno == EINTR, "getrandom failed");
    if (n > 0) got += static_cast<size_t>(n);
  }
  return fmt::format("{:016x}{:016x}", bits[0], bits[1]);
}

}  // namespace kvpool::daemon

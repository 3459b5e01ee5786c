#include "kvpool/util/check.h"

#include <cstdio>
#include <cstdlib>

#include "spdlog/spdlog.h"

namespace kvpool::internal {

void CheckFailed(const char* file, int line, const char* condition, std::string_view message) {
  std::fprintf(stderr, "%s:%d: KVPOOL_CHECK failed: %s%s%.*s\n", file, line, condition,
               message.empty() ? "" : ": ", static_cast<int>(message.size()), message.data());
  // Whatever the loggers buffered is the best record of how we got here.
  spdlog::apply_all([](const std::shared_ptr<spdlog::logger>& logger) { logger->flush(); });
  std::abort();
}

}  // namespace kvpool::internal

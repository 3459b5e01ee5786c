#include "kvpool/util/logging.h"

#include <string>

#include "absl/synchronization/mutex.h"
#include "fmt/format.h"
#include "spdlog/sinks/stdout_color_sinks.h"

namespace kvpool {
namespace {

absl::Mutex logger_mu;

}  // namespace

spdlog::logger& Logger(std::string_view module) {
  const std::string name = fmt::format("kvpool.{}", module);
  absl::MutexLock lock(&logger_mu);
  if (std::shared_ptr<spdlog::logger> existing = spdlog::get(name)) return *existing;
  std::shared_ptr<spdlog::logger> logger = spdlog::stderr_color_mt(name);
  logger->set_level(spdlog::get_level());
  // Loggers are never dropped, so the reference spdlog's registry holds keeps this one alive.
  return *logger;
}

absl::Status SetLogLevel(std::string_view level) {
  const spdlog::level::level_enum parsed = spdlog::level::from_str(std::string(level));
  // from_str maps unknown names to "off"; only accept "off" when it was asked for.
  if (parsed == spdlog::level::off && level != "off") {
    return absl::InvalidArgumentError(fmt::format(
        "unknown log level '{}' (trace, debug, info, warn, error, critical, off)", level));
  }
  absl::MutexLock lock(&logger_mu);
  spdlog::set_level(parsed);  // every registered logger and the default for new ones
  return absl::OkStatus();
}

}  // namespace kvpool

#pragma once

// Named spdlog loggers, one per module ("core", "kernels", "daemon", ...), each called
// "kvpool.<module>". Thread-safe. Nothing per token or per block is logged at info level.

#include <memory>
#include <string_view>

#include "absl/status/status.h"
#include "spdlog/spdlog.h"

namespace kvpool {

// Returns the logger for `module`, creating it (stderr, the current global level) on first use.
// The returned logger lives for the rest of the process.
spdlog::logger& Logger(std::string_view module);

// Sets the level of every kvpool logger, present and future. `level` is one of trace, debug,
// info, warn, error, critical, off. Errors: INVALID_ARGUMENT for any other name (level unchanged).
absl::Status SetLogLevel(std::string_view level);

}  // namespace kvpool

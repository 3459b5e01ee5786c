#pragma once

// kvpoold's configuration: proto/kvpool/v1/config.proto read from a textproto file, with the
// embedded defaults filled in and every field validated at start, and the engine's options made
// from it.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/engine/engine_options.h"
#include "kvpool/v1/config.pb.h"

namespace kvpool::daemon {

// The embedded defaults, as a config: CPU backend, a 256 MiB pool of the tiny model's shape.
v1::DaemonConfig DefaultConfig();

// Parses `path` (empty: no file, all defaults), fills every absent field with its default and
// validates the result. Errors: NOT_FOUND (no such file); INVALID_ARGUMENT whose message lists
// every problem, one per line ("config.textproto:3:5: ..." for parse errors, "pool_bytes: ..."
// for bad values).
absl::StatusOr<v1::DaemonConfig> LoadConfig(const std::string& path);

// Fills absent fields (proto3 zero values) with the defaults. Idempotent.
void ApplyDefaults(v1::DaemonConfig* config);

// One line per problem; empty when the config is usable.
std::vector<std::string> ValidateConfig(const v1::DaemonConfig& config);

// The engine's options for a config ValidateConfig() accepted; `epoch` names this start of the
// daemon. Errors: INVALID_ARGUMENT for a config that does not validate.
absl::StatusOr<EngineOptions> MakeEngineOptions(const v1::DaemonConfig& config, uint64_t epoch);

}  // namespace kvpool::daemon

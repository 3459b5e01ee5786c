#pragma once

// MetricsSpec (config.proto): the /metrics address and the tenant bound, checked at start.

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kvpool/v1/config.pb.h"

namespace kvpool::daemon {

// Tenants per pool with a label of their own when MetricsSpec.max_tenants is absent (0).
inline constexpr int32_t kDefaultMaxTenants = 64;

// The address MetricsSpec.listen names, as "host:port": a bare port ("9400" or ":9400") is on
// 127.0.0.1. Errors: INVALID_ARGUMENT (empty, no port, a port not in [0, 65535], an empty host).
absl::StatusOr<std::string> MetricsBindAddress(std::string_view listen);

// One line per problem of `spec`; empty when it is usable (an empty listen: off).
std::vector<std::string> ValidateMetricsSpec(const v1::MetricsSpec& spec);

}  // namespace kvpool::daemon

#include "daemon/metrics/metrics_config.h"

#include <charconv>

#include "fmt/format.h"

namespace kvpool::daemon {

absl::StatusOr<std::string> MetricsBindAddress(std::string_view listen) {
  if (listen.empty()) return absl::InvalidArgumentError("an empty address");
  const size_t colon = listen.rfind(':');
  std::string_view host = colon == std::string_view::npos ? "" : listen.substr(0, colon);
  const std::string_view port = colon == std::string_view::npos ? listen : listen.substr(colon + 1);
  int value = -1;
  const auto [end, error] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (port.empty() || error != std::errc() || end != port.data() + port.size() || value < 0 ||
      value > 65535) {
    return absl::InvalidArgumentError(
        fmt::format("'{}' has no port in [0, 65535] after its last ':'", listen));
  }
  if (colon != std::string_view::npos && host.empty() && colon != 0) {
    return absl::InvalidArgumentError(fmt::format("'{}' has an empty host", listen));
  }
  if (host.empty()) host = "127.0.0.1";
  return fmt::format("{}:{}", host, value);
}

std::vector<std::string> ValidateMetricsSpec(const v1::MetricsSpec& spec) {
  std::vector<std::string> problems;
  if (!spec.listen().empty()) {
    if (absl::StatusOr<std::string> a = MetricsBindAddress(spec.listen()); !a.ok()) {
      problems.push_back(fmt::format("metrics.listen: {}", std::string(a.status().message())));
    }
  }
  if (spec.max_tenants() < 0 || spec.max_tenants() > 10000) {
    problems.push_back(
        fmt::format("metrics.max_tenants: must be in [0, 10000] (got {})", spec.max_tenants()));
  }
  if (!(spec.block_residency_sample() >= 0 && spec.block_residency_sample() <= 1)) {
    problems.push_back(fmt::format("metrics.block_residency_sample: must be in [0, 1] (got {})",
                                   spec.block_residency_sample()));
  }
  return problems;
}

}  // namespace kvpool::daemon

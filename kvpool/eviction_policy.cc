#include "kvpool/eviction_policy.h"

#include <string>
#include <vector>

#include "fmt/format.h"
#include "kvpool/admission_filter.h"
#include "kvpool/lru_eviction_policy.h"
#include "kvpool/reuse_eviction_policy.h"

namespace kvpool {

absl::StatusOr<EvictionOptions> ParseEvictionSpec(std::string_view spec) {
  if (spec == "default") return ParseEvictionSpec(kDefaultEvictionSpec);
  std::vector<std::string_view> parts;
  for (size_t start = 0;;) {
    const size_t plus = spec.find('+', start);
    parts.push_back(spec.substr(start, plus == std::string_view::npos ? plus : plus - start));
    if (plus == std::string_view::npos) break;
    start = plus + 1;
  }
  EvictionOptions options;
  if (parts[0] == "lru") {
    options.kind = EvictionPolicyKind::kLru;
  } else if (parts[0] == "reuse") {
    options.kind = EvictionPolicyKind::kReuse;
  } else {
    return absl::InvalidArgumentError(fmt::format(
        "unknown eviction policy '{}' in '{}' (known: lru, reuse, default)", parts[0], spec));
  }
  for (size_t i = 1; i < parts.size(); ++i) {
    if (parts[i] == "admit" && !options.admission) {
      options.admission = true;
    } else if (parts[i] == "notail" && options.retain_partial_tails) {
      options.retain_partial_tails = false;
    } else {
      return absl::InvalidArgumentError(
          fmt::format("unknown or repeated eviction modifier '{}' in '{}' (known: +admit, +notail)",
                      parts[i], spec));
    }
  }
  return options;
}

std::string EvictionSpecName(const EvictionOptions& options) {
  std::string name;
  switch (options.kind) {
    case EvictionPolicyKind::kLru:
      name = "lru";
      break;
    case EvictionPolicyKind::kReuse:
      name = "reuse";
      break;
  }
  if (options.admission) name += "+admit";
  if (!options.retain_partial_tails) name += "+notail";
  return name;
}

absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(const EvictionOptions& options,
                                                                   int64_t num_blocks) {
  if (num_blocks <= 0) {
    return absl::InvalidArgumentError(fmt::format("num_blocks must be > 0 (got {})", num_blocks));
  }
  if (options.history_blocks < 0) {
    return absl::InvalidArgumentError(
        fmt::format("history_blocks must be >= 0 (got {})", options.history_blocks));
  }
  if (options.reuse_horizon_ns <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("reuse_horizon_ns must be > 0 (got {})", options.reuse_horizon_ns));
  }
  const int64_t history = options.history_blocks > 0 ? options.history_blocks : 4 * num_blocks;
  std::unique_ptr<EvictionPolicy> policy;
  switch (options.kind) {
    case EvictionPolicyKind::kLru:
      policy = std::make_unique<LruEvictionPolicy>();
      break;
    case EvictionPolicyKind::kReuse:
      policy = std::make_unique<ReuseEvictionPolicy>(options.reuse_horizon_ns, history);
      break;
  }
  if (options.admission) policy = std::make_unique<AdmissionFilter>(std::move(policy), history);
  return policy;
}

absl::StatusOr<std::unique_ptr<EvictionPolicy>> MakeEvictionPolicy(std::string_view spec) {
  absl::StatusOr<EvictionOptions> options = ParseEvictionSpec(spec);
  if (!options.ok()) return options.status();
  return MakeEvictionPolicy(*options, /*num_blocks=*/1);
}

}  // namespace kvpool

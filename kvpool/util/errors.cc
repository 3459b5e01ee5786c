#include "kvpool/util/errors.h"

#include <cstdio>
#include <string>

#include "fmt/format.h"

namespace kvpool {
namespace {

constexpr char kShortfallUrl[] = "type.kvpool.dev/kvpool.Shortfall";

}  // namespace

std::string_view ResourceName(Resource resource) {
  switch (resource) {
    case Resource::kPoolBlocks:
      return "pool";
    case Resource::kNamespaceQuota:
      return "namespace quota";
    case Resource::kSessionQuota:
      return "session quota";
    case Resource::kTableBound:
      return "max_blocks_per_seq";
    case Resource::kPinnedBlocks:
      return "max_pinned_blocks";
    case Resource::kStateSlots:
      return "state slots";
    case Resource::kWindowBlocks:
      return "window group blocks";
  }
  return "unknown";
}

absl::Status ResourceExhausted(Resource resource, int64_t shortfall_blocks, std::string_view what) {
  absl::Status status = absl::ResourceExhaustedError(
      fmt::format("{}: {} short by {} block{}", what, ResourceName(resource), shortfall_blocks,
                  shortfall_blocks == 1 ? "" : "s"));
  status.SetPayload(kShortfallUrl,
                    absl::Cord(fmt::format("{}:{}", static_cast<int>(resource), shortfall_blocks)));
  return status;
}

std::optional<Shortfall> GetShortfall(const absl::Status& status) {
  const absl::optional<absl::Cord> payload = status.GetPayload(kShortfallUrl);
  if (!payload) return std::nullopt;
  const std::string text(*payload);
  int resource = 0;
  long long blocks = 0;
  int consumed = 0;
  if (std::sscanf(text.c_str(), "%d:%lld%n", &resource, &blocks, &consumed) != 2 ||
      consumed != static_cast<int>(text.size()) || resource < 0 ||
      resource > static_cast<int>(Resource::kWindowBlocks)) {
    return std::nullopt;
  }
  return Shortfall{static_cast<Resource>(resource), blocks};
}

}  // namespace kvpool

#pragma once

// Structured errors shared by every module. RESOURCE_EXHAUSTED always says which resource ran out
// and the shortfall in blocks, both in the message and as a payload a caller can read back (the
// daemon forwards it to clients).

#include <cstdint>
#include <optional>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "fmt/format.h"

namespace kvpool {

enum class Resource : uint8_t {
  kPoolBlocks,      // free blocks in the pool (after reclaiming and evicting what can be)
  kNamespaceQuota,  // the namespace's block quota
  kSessionQuota,    // the session's block quota
  kTableBound,      // max_blocks_per_seq
  kPinnedBlocks,    // blocks pins may hold at once (KvCacheOptions::max_pinned_blocks)
  kStateSlots,      // free slots in the pool's state group (one per live sequence)
  kWindowBlocks,    // free blocks in the pool's window group (after reclaiming and evicting)
};

std::string_view ResourceName(Resource resource);

// RESOURCE_EXHAUSTED: "<what>: <resource> short by <shortfall> block(s)", with the payload set.
absl::Status ResourceExhausted(Resource resource, int64_t shortfall_blocks, std::string_view what);

struct Shortfall {
  Resource resource;
  int64_t blocks;
};
// The shortfall carried by a status made by ResourceExhausted(); nullopt for any other status.
std::optional<Shortfall> GetShortfall(const absl::Status& status);

// INTERNAL naming a broken invariant, for CheckInvariants(). `format` has one placeholder per
// argument, checked at compile time (a lambda forwarding parts to fmt::format("{}", parts...)
// kept only the first part).
template <typename... Args>
absl::Status InvariantViolation(fmt::format_string<Args...> format, Args&&... args) {
  return absl::InternalError(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace kvpool

#include "tier/remote_tier.h"

#include "absl/strings/str_cat.h"

namespace kvpool::tier {

absl::StatusOr<LookupResult> RemoteTier::Lookup(const BlockSpace& space, const BlockHash& parent,
                                                std::span<const BlockHash> hashes,
                                                std::span<const std::span<std::byte>> out) {
  if (out.size() != hashes.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tier lookup: ", hashes.size(), " hashes but ", out.size(), " buffers"));
  }
  for (const std::span<std::byte>& buffer : out) {
    if (buffer.empty()) return absl::InvalidArgumentError("tier lookup: an empty buffer");
  }
  if (hashes.empty()) return LookupResult{};
  return LookupChecked(space, parent, hashes, out);
}

}  // namespace kvpool::tier

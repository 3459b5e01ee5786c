#include "tier/internal/redis_memory.h"

#include <algorithm>
#include <bit>

#include "kvpool/util/check.h"

namespace kvpool::tier::internal {
namespace {

// An SDS string's allocation request for `len` bytes: its header (by the type its length needs)
// and the terminating NUL.
int64_t SdsBytes(int64_t len) {
  const int64_t header = len < (int64_t{1} << 8) ? 3 : len < (int64_t{1} << 16) ? 5 : 9;
  return header + len + 1;
}

}  // namespace

int64_t JemallocSizeClass(int64_t bytes) {
  KVPOOL_DCHECK(bytes > 0);
  if (bytes <= 8) return 8;
  if (bytes <= 128) return (bytes + 15) / 16 * 16;
  // bytes in (2^k, 2^(k+1)]: classes 2^k + j * 2^(k-2).
  const int k = 63 - std::countl_zero(static_cast<uint64_t>(bytes - 1));
  const int64_t step = int64_t{1} << (k - 2);
  return (bytes + step - 1) / step * step;
}

int64_t ModeledEntryBytes(int64_t key_bytes, int64_t value_bytes) {
  return JemallocSizeClass(SdsBytes(value_bytes)) + JemallocSizeClass(SdsBytes(key_bytes)) +
         kRedisPerKeyBytes;
}

int64_t RedisEntryCost::Of(int64_t key_bytes, int64_t value_bytes) const {
  const int64_t modeled = ModeledEntryBytes(key_bytes, value_bytes);
  const auto it = usage_.find(value_bytes);
  if (it == usage_.end() || it->second < 0) return modeled;
  return std::max(modeled, it->second + kRedisUnreportedPerKeyBytes);
}

}  // namespace kvpool::tier::internal

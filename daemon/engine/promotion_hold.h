#pragma once

// PromotionHold: blocks a tier promotion copied into the pool for one call, held until that call's
// allocation adopts them (promotion.h has the whole story). A plain value: whoever holds one must
// hand it to ReleaseHold (promotion.h) exactly once, under the engine's lock.

#include <cstdint>

#include "kvpool/util/strong_id.h"

namespace kvpool::daemon {

// The owner of the promotions' loader sequences: no session, so no client can see, free or end
// them.
inline constexpr SessionId kTierLoader{~uint64_t{0}};

// A loader sequence of pool `pool` holding the prompt's first `tokens` tokens, published.
struct PromotionHold {
  int32_t pool = 0;
  SequenceId loader;
  int64_t tokens = 0;
};

}  // namespace kvpool::daemon

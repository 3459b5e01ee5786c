#pragma once

// Strong integer ids: a BlockId cannot be passed where a SequenceId is expected. Raw integers
// appear only at the kernel and wire boundaries (value()).

#include <compare>
#include <cstdint>
#include <ostream>
#include <utility>

namespace kvpool {

template <typename Tag, typename T>
class StrongId {
 public:
  using ValueType = T;

  constexpr StrongId() = default;
  constexpr explicit StrongId(T value) : value_(value) {}

  constexpr T value() const { return value_; }

  friend constexpr bool operator==(StrongId, StrongId) = default;
  friend constexpr auto operator<=>(StrongId, StrongId) = default;

  template <typename H>
  friend H AbslHashValue(H h, StrongId id) {
    return H::combine(std::move(h), id.value_);
  }
  friend std::ostream& operator<<(std::ostream& os, StrongId id) { return os << id.value_; }

 private:
  T value_{};
};

// A block of the pool: a dense index in [0, num_blocks).
using BlockId = StrongId<struct BlockIdTag, int32_t>;
// A sequence (one request's token history). Assigned by the cache, never reused.
using SequenceId = StrongId<struct SequenceIdTag, uint64_t>;
// A connected client process. 0 is "no session" (internal callers, the prefix tree).
using SessionId = StrongId<struct SessionIdTag, uint64_t>;
// A sharing domain of the prefix cache (tenant + model + layout), usually a hash of those.
// 0 is "no namespace": a block that has never been handed out.
using NamespaceId = StrongId<struct NamespaceIdTag, uint64_t>;

inline constexpr BlockId kInvalidBlock{-1};
inline constexpr SessionId kNoSession{0};
inline constexpr NamespaceId kNoNamespace{0};

}  // namespace kvpool

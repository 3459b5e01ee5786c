#pragma once

// Redis Cluster key slots: CRC16-XMODEM of the key (or of its hash tag) modulo 16384, exactly as
// the cluster specification (https://redis.io/docs/reference/cluster-spec/) defines them.
// Pure functions; thread-safe.

#include <cstdint>
#include <string_view>

namespace kvpool::tier {

inline constexpr int kNumClusterSlots = 16384;

// CRC16, CCITT/XMODEM variant (polynomial 0x1021, initial value 0): "123456789" -> 0x31C3.
uint16_t Crc16(std::string_view bytes);

// The part of `key` that is hashed: the bytes between the first '{' and the first '}' after it,
// when that run is non-empty; otherwise the whole key ("{}x" and "x{" hash whole).
std::string_view HashTag(std::string_view key);

// The cluster slot of `key`, in [0, kNumClusterSlots).
int KeySlot(std::string_view key);

}  // namespace kvpool::tier

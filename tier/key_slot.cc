#include "tier/key_slot.h"

#include <array>

namespace kvpool::tier {
namespace {

constexpr std::array<uint16_t, 256> MakeCrc16Table() {
  std::array<uint16_t, 256> table{};
  for (int i = 0; i < 256; ++i) {
    uint16_t crc = static_cast<uint16_t>(i << 8);
    for (int bit = 0; bit < 8; ++bit) {
      crc = (crc & 0x8000) ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                           : static_cast<uint16_t>(crc << 1);
    }
    table[i] = crc;
  }
  return table;
}

constexpr std::array<uint16_t, 256> kCrc16Table = MakeCrc16Table();

}  // namespace

uint16_t Crc16(std::string_view bytes) {
  uint16_t crc = 0;
  for (const char c : bytes) {
    const uint8_t index = static_cast<uint8_t>((crc >> 8) ^ static_cast<uint8_t>(c));
    crc = static_cast<uint16_t>((crc << 8) ^ kCrc16Table[index]);
  }
  return crc;
}

std::string_view HashTag(std::string_view key) {
  const size_t open = key.find('{');
  if (open == std::string_view::npos) return key;
  const size_t close = key.find('}', open + 1);
  if (close == std::string_view::npos || close == open + 1) return key;
  return key.substr(open + 1, close - open - 1);
}

int KeySlot(std::string_view key) { return Crc16(HashTag(key)) & (kNumClusterSlots - 1); }

}  // namespace kvpool::tier

#pragma once

// The Redis tier's wire format: block keys and block values. Pure functions; thread-safe.
//
// Key (content address, DESIGN.md §9), hex digits lower case:
//   kvp1:{<namespace:16>}:<layout:16>:<hash hi:16><hash lo:16>     KeySlotting::kNamespace
//   kvp1:<namespace:16>:<layout:16>:{<hash hi:16><hash lo:16>}     KeySlotting::kBlock
// The chained hash names a block and everything before it, so one key is one block of one
// prefix in one namespace and layout; equal keys hold equal bytes, which is why writes are
// SET NX and never overwrite.
//
// Value: a 72-byte header, little-endian, then the payload (the block's bytes, block-major as
// in DESIGN.md §3):
//   0  u32 magic 'KVPB'         4  u16 version (1)        6  u16 header bytes (72)
//   8  u64 layout fingerprint  16  u64[2] block hash (lo, hi)
//  32  u64[2] parent hash      48  u32 coverage (tokens)  52  u32 reserved (0)
//  56  u64 payload bytes       64  u64 xxh3-64 of the payload
// A reader trusts nothing it did not check: see CheckBlockValue.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "kvpool/kv_events.h"
#include "kvpool/util/strong_id.h"
#include "tier/redis_tier_options.h"

namespace kvpool::tier {

inline constexpr uint32_t kBlockMagic = 0x4250564b;  // "KVPB" little-endian
inline constexpr uint16_t kBlockVersion = 1;
inline constexpr int64_t kBlockHeaderBytes = 72;

// The sharing domain of a stored block: a namespace (tenant + model, DESIGN.md §1) and the
// fingerprint of the pool layout its bytes follow. Blocks of different spaces never meet.
struct BlockSpace {
  NamespaceId ns;
  uint64_t layout_fingerprint = 0;
};

// What a value says about its block.
struct BlockHeader {
  uint64_t layout_fingerprint = 0;
  BlockHash hash;         // the block's chained hash (also in its key)
  BlockHash parent;       // the previous block's chained hash; zero for a chain's first block
  uint32_t coverage = 0;  // tokens the block holds
  int64_t payload_bytes = 0;
  uint64_t checksum = 0;  // xxh3-64 of the payload
};

std::string BlockKey(const BlockSpace& space, const BlockHash& hash, KeySlotting slotting);

// Appends the encoded value (header + payload) to `out`. Fills in payload_bytes and checksum.
void EncodeBlockValue(BlockHeader header, std::span<const std::byte> payload, std::string* out);

// Why a value was refused. kOk is the only outcome that yields data.
enum class BlockCheck : uint8_t {
  kOk,
  kShort,     // shorter than a header
  kMagic,     // wrong magic, version or header size: not ours, or another format version
  kLayout,    // layout fingerprint differs from the key's
  kHash,      // block or parent hash differs from the one asked for
  kLength,    // payload length differs from the header's or from the caller's block size
  kChecksum,  // payload bytes do not match the header's checksum
};
const char* BlockCheckName(BlockCheck check);

struct BlockExpectation {
  uint64_t layout_fingerprint = 0;
  BlockHash hash;
  const BlockHash* parent = nullptr;  // checked when not null
  int64_t payload_bytes = 0;          // exact size the caller expects
};

// Checks `value` against `expect`. On kOk fills `header` and points `payload` into `value`;
// otherwise leaves both unspecified.
BlockCheck CheckBlockValue(std::string_view value, const BlockExpectation& expect,
                           BlockHeader* header, std::span<const std::byte>* payload);

}  // namespace kvpool::tier

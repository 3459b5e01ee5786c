#pragma once

// The Redis tier's wire format: block keys and block values, both under the deployment secret
// (tier/secret.h, DESIGN.md §7, §9). Pure functions of their arguments; thread-safe.
//
// Key, hex digits lower case:
//   kvp2:{<space:16>}:<block:32>     KeySlotting::kNamespace
//   kvp2:<space:16>:{<block:32>}     KeySlotting::kBlock
// space = Mac64("kvpool redis space v2", namespace id, layout fingerprint), and block = the
// first 16 bytes of Mac("kvpool redis block v2", namespace id, layout fingerprint, block hash)
// (integers as 8 little-endian bytes; the hash lo then hi). Whoever lacks the secret can neither
// name the key of a block (nor ask whether a tenant holds a prompt) nor tell two keys' spaces
// apart; the hash tag keeps each KeySlotting's slot sharing (every block of a space in one slot,
// or each block in its own). The chained hash names a block and everything before it, so one
// key is one block of one prefix in one namespace and layout.
//
// Value: a 96-byte header, little-endian, then the payload (the block's bytes, block-major as
// in DESIGN.md §3):
//   0  u32 magic 'KVPB'         4  u16 version (2)        6  u16 header bytes (96)
//   8  u64 layout fingerprint  16  u64[2] block hash (lo, hi)
//  32  u64[2] parent hash      48  u32 coverage (tokens)  52  u32 reserved (0)
//  56  u64 payload bytes       64  u8[16] nonce           80  u8[16] tag
// tag = Poly1305(otk, u64 key length || key || header bytes 0..80 || payload), under the
// one-time key otk = Mac("kvpool redis value poly1305 v2", nonce, key). The writer draws a fresh
// random nonce for every value it encodes, so no one-time key ever authenticates two messages
// (what Poly1305 requires); binding the key makes a value copied under another key fail.
// Poly1305 rather than HMAC-SHA256 over the payload: it runs at about 13 GB/s here against
// HMAC-SHA256's 1.7 GB/s, which would have cost Redis promotions more than half their throughput
// (the commit that introduced version 2 has the numbers).
//
// Version 1 (an xxh3 checksum in place of nonce and tag, 72-byte header, kvp1 keys) is not read:
// its values fail the version check, and their keys are never asked for.
// A reader trusts nothing it did not check: see CheckBlockValue.

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "kvpool/kv_events.h"
#include "kvpool/util/strong_id.h"
#include "tier/redis_tier_options.h"
#include "tier/secret.h"

namespace kvpool::tier {

inline constexpr uint32_t kBlockMagic = 0x4250564b;  // "KVPB" little-endian
inline constexpr uint16_t kBlockVersion = 2;
inline constexpr int64_t kBlockHeaderBytes = 96;
inline constexpr int64_t kBlockNonceOffset = 64;
inline constexpr int64_t kBlockTagOffset = 80;

// Drawn afresh for every encoded value (RandomValueNonce).
using ValueNonce = std::array<uint8_t, 16>;

// The sharing domain of a stored block: a namespace (tenant + model, DESIGN.md §1) and the
// fingerprint of the pool layout its bytes follow. Blocks of different spaces never meet.
struct BlockSpace {
  NamespaceId ns;
  uint64_t layout_fingerprint = 0;
};

// What a value says about its block.
struct BlockHeader {
  uint64_t layout_fingerprint = 0;
  BlockHash hash;         // the block's chained hash (its key is derived from it)
  BlockHash parent;       // the previous block's chained hash; zero for a chain's first block
  uint32_t coverage = 0;  // tokens the block holds
  int64_t payload_bytes = 0;
};

// The keys of one space's blocks: the space's tag is computed once, then each Key() costs one
// HMAC-SHA256. Keeps a reference to `secret`, which must outlive it.
class SpaceKeys final {
 public:
  SpaceKeys(const DeploymentSecret& secret, const BlockSpace& space, KeySlotting slotting);
  std::string Key(const BlockHash& hash) const;

 private:
  const DeploymentSecret& secret_;
  const BlockSpace space_;
  const KeySlotting slotting_;
  const std::string space_tag_;  // 16 hex digits
};

// SpaceKeys(secret, space, slotting).Key(hash).
std::string BlockKey(const DeploymentSecret& secret, const BlockSpace& space, const BlockHash& hash,
                     KeySlotting slotting);

// 16 bytes from OpenSSL's CSPRNG (RAND_bytes).
ValueNonce RandomValueNonce();

// A Poly1305 tag under the one-time key Mac(`domain`, nonce, `key`) (secret.h) over `parts`, in
// order: the construction of the Redis values' tag above, shared by the disk tier's records
// (disk_format.h). REQUIRES: no (domain, nonce, key) ever authenticates two different messages.
using ValueTag = std::array<uint8_t, 16>;
ValueTag OneTimeTag(const DeploymentSecret& secret, std::string_view domain,
                    const ValueNonce& nonce, std::string_view key,
                    std::initializer_list<std::string_view> parts);

// Appends the encoded value of `payload` stored under `key` (header + payload) to `out`.
// Fills in payload_bytes. REQUIRES: `nonce` was never used for another value (RandomValueNonce).
void EncodeBlockValue(const DeploymentSecret& secret, std::string_view key, const ValueNonce& nonce,
                      BlockHeader header, std::span<const std::byte> payload, std::string* out);

// Why a value was refused. kOk is the only outcome that yields data.
enum class BlockCheck : uint8_t {
  kOk,
  kShort,   // shorter than a header
  kMagic,   // wrong magic, version or header size: not ours, or another format version
  kLength,  // payload length differs from the header's or from the caller's block size
  // The tag does not verify: forged without the secret, damaged, written under another secret,
  // or copied from another key. Checked before any field below.
  kMac,
  kLayout,  // layout fingerprint differs from the one asked for
  kHash,    // block or parent hash differs from the one asked for
};
const char* BlockCheckName(BlockCheck check);

struct BlockExpectation {
  uint64_t layout_fingerprint = 0;
  BlockHash hash;
  const BlockHash* parent = nullptr;  // checked when not null
  int64_t payload_bytes = 0;          // exact size the caller expects
};

// Checks `value`, read from `key`, against `expect`: format and lengths, then the tag (in
// constant time), then the header's fields. On kOk fills `header` and points `payload` into
// `value`; otherwise leaves both unspecified.
BlockCheck CheckBlockValue(const DeploymentSecret& secret, std::string_view key,
                           std::string_view value, const BlockExpectation& expect,
                           BlockHeader* header, std::span<const std::byte>* payload);

// CheckBlockValue for a value read in two pieces: its first kBlockHeaderBytes bytes `head` and
// the rest, `payload` (a reader that read the payload straight into its destination). Same
// checks, same order, same results; on kOk fills `header`.
BlockCheck CheckBlockParts(const DeploymentSecret& secret, std::string_view key,
                           std::string_view head, std::span<const std::byte> payload,
                           const BlockExpectation& expect, BlockHeader* header);

}  // namespace kvpool::tier

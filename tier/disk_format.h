#pragma once

// The disk tier's on-disk format (docs/tiers.md): three files in the store's directory. Pure
// functions of their arguments; thread-safe.
//
//   tier.meta    one 4096-byte superblock: what the files hold and under which secret.
//   blocks.kvd   `slots` record slots of slot_bytes each (a block's bytes, padded to 4096 so
//                O_DIRECT can read and write them in place); slot i at i * slot_bytes.
//   index.kvi    `slots` index entries of 128 bytes; entry i describes slot i.
//
// Superblock, little-endian:
//   0  u64 magic "KVPDTIER"   8  u32 format version (1)   12 u32 superblock bytes (4096)
//  16  u64 deployment secret fingerprint (DeploymentSecret::fingerprint, never the secret)
//  24  u64 layout fingerprint 32  u64 content fingerprint (the daemon's model)
//  40  i64 block bytes        48  i64 slot bytes          56  i64 slots
//  64  u64 xxh3-64 of bytes 0..64
//
// Index entry, little-endian (an entry whose magic is 0 marks a free slot):
//   0  u32 magic 'KVPI'       4  u16 version (1)          6  u16 entry bytes (128)
//   8  u64 namespace id      16  u64[2] block hash       32  u64[2] parent hash
//  48  u32 coverage          52  u32 reserved (0)         56  u64 payload bytes
//  64  u64 tenant tag        72  u64 model tag (NamespaceTags)
//  80  u64 write sequence (orders the least recently used list when the index is rebuilt)
//  88  u8[16] nonce         104  u8[16] tag              120  u64 xxh3-64 of bytes 0..120
// tag = Poly1305(otk, u64 layout fingerprint || entry bytes 0..88 || payload) with the one-time
// key otk = Mac("kvpool disk record poly1305 v1", nonce) (block_codec.h OneTimeTag). Every record
// gets a fresh random nonce. The checksum finds a torn or stale entry at scan time; the tag,
// checked on every read against the slot's bytes, finds a torn, truncated or overwritten slot, a
// file from another layout or secret, and anything written without the secret: each is a miss,
// never data.
//
// Crash safety needs no write ordering: a slot's bytes are written before its entry, and a reader
// trusts a slot only when the entry's tag verifies over the bytes it read, so an entry that
// reached the disk without its bytes (or the other way round) is a miss, dropped when read.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvpool/kv_events.h"
#include "kvpool/util/strong_id.h"
#include "tier/block_codec.h"
#include "tier/remote_tier.h"
#include "tier/secret.h"

namespace kvpool::tier {

inline constexpr uint32_t kDiskFormatVersion = 1;
inline constexpr int64_t kDiskAlign = 4096;  // O_DIRECT's alignment of offsets, sizes, buffers
inline constexpr int64_t kSuperblockBytes = 4096;
inline constexpr int64_t kIndexEntryBytes = 128;

struct Superblock {
  uint32_t version = kDiskFormatVersion;
  uint64_t secret_fingerprint = 0;
  uint64_t layout_fingerprint = 0;
  uint64_t content_fingerprint = 0;
  int64_t block_bytes = 0;
  int64_t slot_bytes = 0;
  int64_t slots = 0;
};

enum class SuperblockCheck : uint8_t {
  kOk,
  kMissing,  // not a superblock at all (short, wrong magic, bad checksum): a new directory
  kVersion,  // another format version: written by an incompatible kvpoold
};

// `out` must hold kSuperblockBytes.
void EncodeSuperblock(const Superblock& sb, std::span<std::byte> out);
SuperblockCheck DecodeSuperblock(std::span<const std::byte> in, Superblock* sb);

// What an index entry says about its slot.
struct IndexEntry {
  NamespaceId ns;
  BlockHash hash;
  BlockHash parent;
  uint32_t coverage = 0;
  int64_t payload_bytes = 0;
  NamespaceTags tags;
  uint64_t sequence = 0;
  ValueNonce nonce{};
  ValueTag tag{};
};

// Fills entry.tag for `payload`, under `secret`, for a store of layout `layout_fingerprint`
// (entry.nonce drawn by the caller: RandomValueNonce).
void SealEntry(const DeploymentSecret& secret, uint64_t layout_fingerprint,
               std::span<const std::byte> payload, IndexEntry* entry);
// Whether entry.tag verifies over `payload` (constant time).
bool VerifyEntry(const DeploymentSecret& secret, uint64_t layout_fingerprint,
                 std::span<const std::byte> payload, const IndexEntry& entry);

// `out` must hold kIndexEntryBytes. A free slot's entry is all zero bytes.
void EncodeIndexEntry(const IndexEntry& entry, std::span<std::byte> out);

enum class EntryCheck : uint8_t {
  kOk,
  kFree,     // all zero magic: nothing stored
  kDamaged,  // torn, another version, or a checksum that fails
};
EntryCheck DecodeIndexEntry(std::span<const std::byte> in, IndexEntry* entry);

// `bytes` rounded up to kDiskAlign.
inline int64_t AlignUp(int64_t bytes) { return (bytes + kDiskAlign - 1) / kDiskAlign * kDiskAlign; }

}  // namespace kvpool::tier

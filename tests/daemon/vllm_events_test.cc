// kvpool's events in vLLM's KV-event wire format, checked byte for byte against encodings derived
// by hand from the msgpack specification (github.com/msgpack/msgpack/blob/master/spec.md) and
// msgspec's rules for `array_like=True, tag=True` structs: an array of the tag (the class name,
// a str) and the fields in declaration order; floats as float64; ints in their shortest form.

#include "daemon/edge/vllm_events.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool::daemon {
namespace {

std::string Bytes(std::initializer_list<int> bytes) {
  std::string out;
  for (int b : bytes) out.push_back(static_cast<char>(b));
  return out;
}
std::string Str(std::string_view s) {  // fixstr: 0xa0 | length, then the bytes
  return Bytes({0xa0 | static_cast<int>(s.size())}) + std::string(s);
}
// 16 bytes 0x00..0x0f (hi) then 0x10..0x1f (lo) as bin 8: 0xc4, length, bytes.
const BlockHash kHash{.lo = 0x1011121314151617, .hi = 0x0001020304050607};
std::string HashBin() {
  return Bytes({0xc4, 0x10, 0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x10, 0x11, 0x12, 0x13,
                0x14, 0x15, 0x16, 0x17});
}
// 1.5 as float 64: 0xcb, then IEEE 754 binary64 big-endian (0x3ff8000000000000).
std::string Ts() { return Bytes({0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0}); }

TEST(VllmEventsTest, BlockStoredIsTheTaggedArrayOfItsSevenFields) {
  KvEvent e{.seq = 5, .type = KvEventType::kBlockStored};
  e.block_hashes = {kHash};
  e.token_ids = {1, 200, 70000, -3};
  e.block_size = 16;
  e.medium = KvMedium::kDevice;
  const std::string expected =
      Bytes({0x93}) + Ts() + Bytes({0x91}) +  // [ts, [event], rank]
      Bytes({0x97}) + Str("BlockStored") +    // 7 items: the tag, then 6 fields
      Bytes({0x91}) + HashBin() +             // block_hashes: [hash]
      Bytes({0xc0}) +                         // parent_block_hash: nil (a root block)
      // token_ids: [1 (positive fixint), 200 (uint 8), 70000 (uint 32), -3 (negative fixint)]
      Bytes({0x94, 0x01, 0xcc, 0xc8, 0xce, 0x00, 0x01, 0x11, 0x70, 0xfd}) +
      Bytes({0x10}) +  // block_size 16
      Bytes({0xc0}) +  // lora_id: nil
      Str("GPU") +     // medium
      Bytes({0x02});   // data_parallel_rank 2
  EXPECT_EQ(EncodeVllmBatch(std::span(&e, 1), 1.5, 2), expected);
}

TEST(VllmEventsTest, AParentHashAndTheTiersMedia) {
  KvEvent e{.type = KvEventType::kBlockStored};
  e.block_hashes = {kHash};
  e.parent_hash = kHash;
  e.block_size = 16;
  e.medium = KvMedium::kHost;  // a tier event: no tokens
  const std::string expected = Bytes({0x93}) + Ts() + Bytes({0x91, 0x97}) + Str("BlockStored") +
                               Bytes({0x91}) + HashBin() + HashBin() + Bytes({0x90, 0x10, 0xc0}) +
                               Str("CPU") + Bytes({0x00});
  EXPECT_EQ(EncodeVllmBatch(std::span(&e, 1), 1.5, 0), expected);
  EXPECT_EQ(VllmMedium(KvMedium::kDisk), "DISK");
}

// A hybrid pool's events go on with vLLM's later fields: Stored with lora_name, extra_keys,
// group_idx, kv_cache_spec_kind and kv_cache_spec_sliding_window; Removed with group_idx.
TEST(VllmEventsTest, AHybridPoolsEventsCarryTheirGroup) {
  std::vector<KvEvent> events(3);
  events[0].type = KvEventType::kBlockStored;
  events[0].block_hashes = {kHash};
  events[0].block_size = 16;
  events[0].group =
      KvEventGroup{.index = 1, .kind = KvGroupKind::kSlidingWindow, .sliding_window = 256};
  events[1] = events[0];
  events[1].group = KvEventGroup{};  // the main blocks: full attention, no window
  events[2].type = KvEventType::kBlockRemoved;
  events[2].block_hashes = {kHash};
  events[2].group = KvEventGroup{.index = 2, .kind = KvGroupKind::kStateSpace};
  const std::string stored_head = Bytes({0x9c}) + Str("BlockStored") +  // 12 items
                                  Bytes({0x91}) + HashBin() + Bytes({0xc0, 0x90, 0x10, 0xc0}) +
                                  Str("GPU") + Bytes({0xc0, 0xc0});  // lora_name, extra_keys nil
  const std::string expected =
      Bytes({0x93}) + Ts() + Bytes({0x93}) +  //
      stored_head + Bytes({0x01}) + Str("sliding_window") + Bytes({0xcd, 0x01, 0x00}) +
      stored_head + Bytes({0x00}) + Str("full_attention") + Bytes({0xc0}) + Bytes({0x94}) +
      Str("BlockRemoved") + Bytes({0x91}) + HashBin() + Str("GPU") + Bytes({0x02}) +  // group_idx
      Bytes({0x00});
  EXPECT_EQ(EncodeVllmBatch(events, 1.5, 0), expected);
  EXPECT_EQ(GroupKindName(KvGroupKind::kStateSpace), "mamba");
}

TEST(VllmEventsTest, BlockRemovedAndAllBlocksCleared) {
  std::vector<KvEvent> events(2);
  events[0].type = KvEventType::kBlockRemoved;
  events[0].block_hashes = {kHash, kHash};
  events[0].medium = KvMedium::kDisk;
  events[1].type = KvEventType::kAllBlocksCleared;
  const std::string expected = Bytes({0x93}) + Ts() + Bytes({0x92}) +  // two events
                               Bytes({0x93}) + Str("BlockRemoved") + Bytes({0x92}) + HashBin() +
                               HashBin() + Str("DISK") +  //
                               Bytes({0x91}) + Str("AllBlocksCleared") + Bytes({0x00});
  EXPECT_EQ(EncodeVllmBatch(events, 1.5, 0), expected);
}

TEST(VllmEventsTest, AResyncStartsWithAllBlocksCleared) {
  const std::string expected =
      Bytes({0x93}) + Ts() + Bytes({0x91, 0x91}) + Str("AllBlocksCleared") + Bytes({0x00});
  EXPECT_EQ(EncodeVllmBatch({}, 1.5, 0, /*clear_first=*/true), expected);
}

TEST(VllmEventsTest, LongArraysTakeTheArray16Header) {
  // 20 tokens: more than a fixarray holds (15), so 0xdc and a 16-bit length.
  KvEvent e{.type = KvEventType::kBlockStored, .block_size = 20};
  e.block_hashes = {kHash};
  e.token_ids.assign(20, 7);
  const std::string encoded = EncodeVllmBatch(std::span(&e, 1), 1.5, 0);
  const std::string tokens = Bytes({0xdc, 0x00, 0x14}) + std::string(20, '\x07');
  EXPECT_NE(encoded.find(Bytes({0xc0}) + tokens + Bytes({0x14, 0xc0})), std::string::npos);
}

}  // namespace
}  // namespace kvpool::daemon

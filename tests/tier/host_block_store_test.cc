#include "tier/host_block_store.h"

#include <algorithm>
#include <vector>

#include "gtest/gtest.h"
#include "tests/tier/test_chain.h"

namespace kvpool::tier {
namespace {

using testing::MakeChain;

constexpr int64_t kBlockBytes = 256;
const BlockSpace kSpace{NamespaceId(7), 0x1234};

std::vector<std::vector<std::byte>> Buffers(size_t n) {
  return std::vector<std::vector<std::byte>>(n, std::vector<std::byte>(kBlockBytes));
}
std::vector<std::span<std::byte>> Spans(std::vector<std::vector<std::byte>>& buffers) {
  return {buffers.begin(), buffers.end()};
}

TEST(HostBlockStoreTest, StoredChainComesBackByteForByte) {
  auto store = HostBlockStore::Create(8, kBlockBytes);
  ASSERT_TRUE(store.ok()) << store.status();
  const auto chain = MakeChain(kSpace, 4, kBlockBytes, 1);
  EXPECT_EQ(chain.Put(**store), 4);
  auto buffers = Buffers(4);
  auto found = (*store)->Lookup(kSpace, BlockHash{}, chain.hashes, Spans(buffers));
  ASSERT_TRUE(found.ok());
  EXPECT_EQ(found->hits, 4);
  EXPECT_EQ(found->coverage, std::vector<uint32_t>(4, 16));
  EXPECT_EQ(buffers, chain.blocks);
  // From the middle of the chain: the parent is the block before.
  auto tail = Buffers(2);
  found =
      (*store)->Lookup(kSpace, chain.hashes[1], std::span(chain.hashes).subspan(2), Spans(tail));
  EXPECT_EQ(found->hits, 2);
  EXPECT_EQ(tail[1], chain.blocks[3]);
}

TEST(HostBlockStoreTest, OtherSpacesAndWrongParentsMiss) {
  auto store = *HostBlockStore::Create(8, kBlockBytes);
  const auto chain = MakeChain(kSpace, 3, kBlockBytes, 2);
  chain.Put(*store);
  auto buffers = Buffers(3);
  for (const BlockSpace other : {BlockSpace{NamespaceId(8), kSpace.layout_fingerprint},
                                 BlockSpace{kSpace.ns, kSpace.layout_fingerprint + 1}}) {
    EXPECT_EQ(store->Lookup(other, BlockHash{}, chain.hashes, Spans(buffers))->hits, 0);
  }
  // Block 1 asked for under another parent: not the chain it was stored in.
  auto one = Buffers(1);
  EXPECT_EQ(
      store->Lookup(kSpace, BlockHash{1, 2}, std::span(chain.hashes).subspan(1, 1), Spans(one))
          ->hits,
      0);
  EXPECT_EQ(store->stats().corrupt, 1u);
  // A hole stops the run: only the leading blocks count.
  std::vector<BlockHash> holed = chain.hashes;
  holed[1] = BlockHash{9, 9};
  EXPECT_EQ(store->Lookup(kSpace, BlockHash{}, holed, Spans(buffers))->hits, 1);
}

TEST(HostBlockStoreTest, FullStoreEvictsTheLeastRecentlyUsed) {
  auto store = *HostBlockStore::Create(3, kBlockBytes);
  const auto chain = MakeChain(kSpace, 4, kBlockBytes, 3);
  auto put = [&](int i) {
    return store->Put(kSpace,
                      {.hash = chain.hashes[static_cast<size_t>(i)],
                       .parent = i == 0 ? BlockHash{} : chain.hashes[static_cast<size_t>(i - 1)],
                       .coverage = 16,
                       .bytes = chain.blocks[static_cast<size_t>(i)]});
  };
  EXPECT_TRUE(put(0) && put(1) && put(2));
  auto one = Buffers(1);
  // Touch block 0: block 1 is now the least recently used and goes when block 3 comes.
  EXPECT_EQ(store->Lookup(kSpace, BlockHash{}, std::span(chain.hashes).first(1), Spans(one))->hits,
            1);
  EXPECT_TRUE(put(3));
  EXPECT_EQ(store->stored(), 3);
  EXPECT_EQ(store->evicted(), 1u);
  auto buffers = Buffers(4);
  EXPECT_EQ(store->Lookup(kSpace, BlockHash{}, chain.hashes, Spans(buffers))->hits, 1);
  auto two = Buffers(2);
  EXPECT_EQ(
      store->Lookup(kSpace, chain.hashes[1], std::span(chain.hashes).subspan(2), Spans(two))->hits,
      2);
  EXPECT_EQ(store->stats().already_present, 0u);
  EXPECT_TRUE(put(3));
  EXPECT_EQ(store->stats().already_present, 1u);
}

TEST(HostBlockStoreTest, TheListenerHearsOfEveryStoredAndDroppedBlock) {
  auto store = *HostBlockStore::Create(2, kBlockBytes);
  std::vector<std::pair<BlockHash, bool>> heard;
  store->set_listener(
      [&](const BlockSpace& space, const BlockHash& hash, const BlockHash&, bool stored) {
        EXPECT_EQ(space.ns, kSpace.ns);
        heard.emplace_back(hash, stored);
      });
  const auto chain = MakeChain(kSpace, 3, kBlockBytes, 4);
  EXPECT_EQ(chain.Put(*store), 3);
  auto put = [&](size_t i) {
    store->Put(kSpace, {.hash = chain.hashes[i],
                        .parent = i == 0 ? BlockHash{} : chain.hashes[i - 1],
                        .coverage = 16,
                        .bytes = chain.blocks[i]});
  };
  put(2);  // there: touched, nothing to hear
  put(0);  // back, in the place of block 1, now the least recently used
  const std::vector<std::pair<BlockHash, bool>> want = {
      {chain.hashes[0], true}, {chain.hashes[1], true},  {chain.hashes[0], false},
      {chain.hashes[2], true}, {chain.hashes[1], false}, {chain.hashes[0], true}};
  EXPECT_EQ(heard, want);
}

TEST(HostBlockStoreTest, SlotsCanLiveInMemoryTheCallerOwns) {
  std::vector<std::byte> memory(4 * kBlockBytes);
  EXPECT_EQ(HostBlockStore::Create(4, kBlockBytes, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto store = HostBlockStore::Create(4, kBlockBytes, memory.data());
  ASSERT_TRUE(store.ok()) << store.status();
  const auto chain = MakeChain(kSpace, 2, kBlockBytes, 5);
  chain.Put(**store);
  // The bytes are in the caller's memory, slot by slot.
  EXPECT_TRUE(std::equal(chain.blocks[0].begin(), chain.blocks[0].end(), memory.begin()));
  auto buffers = Buffers(2);
  EXPECT_EQ((*store)->Lookup(kSpace, BlockHash{}, chain.hashes, Spans(buffers))->hits, 2);
  EXPECT_EQ(buffers, chain.blocks);
}

TEST(HostBlockStoreTest, BadSizesAreRefused) {
  EXPECT_EQ(HostBlockStore::Create(0, kBlockBytes).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HostBlockStore::Create(4, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HostBlockStore::Create(int64_t{1} << 40, kBlockBytes).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto store = *HostBlockStore::Create(2, kBlockBytes);
  std::vector<std::byte> small(kBlockBytes - 1);
  EXPECT_FALSE(store->Put(kSpace, {.hash = BlockHash{1, 1}, .coverage = 16, .bytes = small}));
  EXPECT_EQ(store->stored(), 0);
  EXPECT_EQ(store->stats().dropped_write_errors, 1u);
  std::vector<BlockHash> hashes{BlockHash{1, 1}};
  std::vector<std::span<std::byte>> none;
  EXPECT_EQ(store->Lookup(kSpace, BlockHash{}, hashes, none).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// Pinned reads (promotions copy straight from the slots): the bytes of a pinned slot stay as they
// are, whatever is put meanwhile, and a full store of pinned slots drops new blocks instead.
TEST(HostBlockStoreTest, PinnedSlotsAreNeitherEvictedNorOverwritten) {
  auto store = *HostBlockStore::Create(3, kBlockBytes);
  const auto chain = MakeChain(kSpace, 6, kBlockBytes, 6);
  auto put = [&](size_t i) {
    return store->Put(kSpace, {.hash = chain.hashes[i],
                               .parent = i == 0 ? BlockHash{} : chain.hashes[i - 1],
                               .coverage = 16,
                               .bytes = chain.blocks[i]});
  };
  EXPECT_TRUE(put(0) && put(1) && put(2));  // block 0 is the least recently used
  HostBlockStore::Pins pins = store->LookupPinned(kSpace, BlockHash{}, std::span(chain.hashes));
  ASSERT_EQ(pins.size(), 3);
  pins = store->LookupPinned(kSpace, BlockHash{}, std::span(chain.hashes).first(1));
  ASSERT_EQ(pins.size(), 1);  // the move let blocks 1 and 2 go: only block 0 is pinned now
  EXPECT_EQ(store->pinned(), 1);
  EXPECT_EQ(store->stats().hits, 4u);
  // Three new blocks: each evicts an unpinned one, never block 0's slot.
  EXPECT_TRUE(put(3) && put(4) && put(5));
  EXPECT_EQ(store->evicted(), 3u);
  const std::span<const std::byte> pinned = pins.block(0);
  EXPECT_TRUE(std::equal(pinned.begin(), pinned.end(), chain.blocks[0].begin()));
  auto one = Buffers(1);
  EXPECT_EQ(store->Lookup(kSpace, BlockHash{}, std::span(chain.hashes).first(1), Spans(one))->hits,
            1);
  // Every slot pinned: a new block has no room and is dropped (counted), nothing is overwritten.
  HostBlockStore::Pins more =
      store->LookupPinned(kSpace, chain.hashes[3], std::span(chain.hashes).subspan(4));
  ASSERT_EQ(more.size(), 2);
  EXPECT_EQ(store->pinned(), 3);
  const std::vector<std::byte> other(kBlockBytes, std::byte{0x5a});
  EXPECT_FALSE(store->Put(kSpace, {.hash = BlockHash{7, 7}, .coverage = 16, .bytes = other}));
  EXPECT_EQ(store->stats().dropped_queue_full, 1u);
  EXPECT_TRUE(put(5));  // already there: only counted
  EXPECT_TRUE(std::equal(pinned.begin(), pinned.end(), chain.blocks[0].begin()));
  // Unpinned, the slots are the most recently used again, and evictable.
  more.Release();
  pins.Release();
  EXPECT_EQ(store->pinned(), 0);
  EXPECT_TRUE(store->Put(kSpace, {.hash = BlockHash{7, 7}, .coverage = 16, .bytes = other}));
  EXPECT_EQ(store->stored(), 3);
}

// An invalidation drops a pinned block from the index at once, but its slot is reused only after
// the last pin goes.
TEST(HostBlockStoreTest, AnInvalidatedPinnedSlotIsFreedByItsLastUnpin) {
  auto store = *HostBlockStore::Create(2, kBlockBytes);
  const auto chain = MakeChain(kSpace, 2, kBlockBytes, 7);
  const NamespaceTags tags{.tenant = 1, .model = 2};
  for (size_t i = 0; i < 2; ++i) {
    ASSERT_TRUE(store->Put(kSpace, {.hash = chain.hashes[i],
                                    .parent = i == 0 ? BlockHash{} : chain.hashes[i - 1],
                                    .coverage = 16,
                                    .bytes = chain.blocks[i],
                                    .tags = tags}));
  }
  HostBlockStore::Pins pins = store->LookupPinned(kSpace, BlockHash{}, std::span(chain.hashes));
  HostBlockStore::Pins twice =
      store->LookupPinned(kSpace, BlockHash{}, std::span(chain.hashes).first(1));
  ASSERT_EQ(pins.size(), 2);
  EXPECT_EQ(store->Invalidate({.tenant = 1}), 2);
  EXPECT_EQ(store->stored(), 0);
  EXPECT_EQ(store->LookupPinned(kSpace, BlockHash{}, std::span(chain.hashes)).size(), 0);
  // No slot is free while both are pinned: a new block is dropped, the pinned bytes stay.
  const std::vector<std::byte> other(kBlockBytes, std::byte{0x77});
  EXPECT_FALSE(store->Put(kSpace, {.hash = BlockHash{9, 9}, .coverage = 16, .bytes = other}));
  pins.Release();  // block 1's slot is free now; block 0's is still pinned by `twice`
  EXPECT_TRUE(store->Put(kSpace, {.hash = BlockHash{9, 9}, .coverage = 16, .bytes = other}));
  // The next one takes that slot again (evicting block {9, 9}), never block 0's.
  EXPECT_TRUE(store->Put(kSpace, {.hash = BlockHash{8, 8}, .coverage = 16, .bytes = other}));
  EXPECT_EQ(store->evicted(), 1u);
  const std::span<const std::byte> first = twice.block(0);
  EXPECT_TRUE(std::equal(first.begin(), first.end(), chain.blocks[0].begin()));
  twice.Release();
  EXPECT_TRUE(store->Put(kSpace, {.hash = BlockHash{6, 6}, .coverage = 16, .bytes = other}));
  EXPECT_EQ(store->stored(), 2);
  EXPECT_EQ(store->evicted(), 1u);
  EXPECT_EQ(store->pinned(), 0);
}

}  // namespace
}  // namespace kvpool::tier

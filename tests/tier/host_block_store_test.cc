#include "tier/host_block_store.h"

#include <algorithm>
#include <map>
#include <random>
#include <span>
#include <tuple>
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

// Puts `n` single blocks of tenant `tenant` (a chain of their own under namespace `ns`), each
// tagged with it. Returns their hashes.
std::vector<BlockHash> PutTenantBlocks(HostBlockStore& store, uint64_t tenant, NamespaceId ns,
                                       int n, uint32_t seed) {
  const BlockSpace space{ns, kSpace.layout_fingerprint};
  const auto chain = MakeChain(space, n, kBlockBytes, seed);
  for (size_t i = 0; i < chain.hashes.size(); ++i) {
    EXPECT_TRUE(store.Put(space, {.hash = chain.hashes[i],
                                  .parent = i == 0 ? BlockHash{} : chain.hashes[i - 1],
                                  .coverage = 16,
                                  .bytes = chain.blocks[i],
                                  .tags = {.tenant = tenant, .model = 1}}));
  }
  return chain.hashes;
}

// Whether the store holds all of `hashes` (a chain from the root in `ns`).
bool HoldsChain(HostBlockStore& store, NamespaceId ns, const std::vector<BlockHash>& hashes) {
  auto buffers = Buffers(hashes.size());
  const auto found =
      store.Lookup({ns, kSpace.layout_fingerprint}, BlockHash{}, hashes, Spans(buffers));
  return found.ok() && found->hits == static_cast<int64_t>(hashes.size());
}

// A tenant that floods a full store evicts its own blocks, not another tenant's prefix; with
// one order for all (max_shares 0, the store before it was fair) the prefix is gone.
TEST(HostBlockStoreFairTest, AFloodingTenantEvictsItsOwnBlocksNotAnothersPrefix) {
  for (const int32_t shares : {HostBlockStore::kDefaultShares, 0}) {
    auto store = *HostBlockStore::Create(10, kBlockBytes, shares);
    const std::vector<BlockHash> prefix = PutTenantBlocks(*store, 11, NamespaceId(1), 3, 1);
    PutTenantBlocks(*store, 22, NamespaceId(2), 100, 2);
    EXPECT_EQ(store->stored(), 10);
    ASSERT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();
    if (shares == 0) {
      EXPECT_FALSE(HoldsChain(*store, NamespaceId(1), prefix));
      continue;
    }
    EXPECT_TRUE(HoldsChain(*store, NamespaceId(1), prefix));
    EXPECT_EQ(store->stored_by(11), 3);
    EXPECT_EQ(store->stored_by(22), 7);
    EXPECT_EQ(store->evicted_from(11), 0u);
    EXPECT_EQ(store->evicted_from(22), 93u);
    // Once the quiet tenant holds more than the other, it gives first (its least recent block).
    PutTenantBlocks(*store, 11, NamespaceId(3), 5, 3);
    EXPECT_EQ(store->stored_by(11), 5);
    EXPECT_EQ(store->stored_by(22), 5);
    PutTenantBlocks(*store, 11, NamespaceId(4), 1, 4);
    EXPECT_EQ(store->stored_by(11), 5);
    EXPECT_FALSE(HoldsChain(*store, NamespaceId(1), prefix));  // its oldest block went first
  }
}

// Weights split a store both tenants fill: 3:1 gives about three quarters to the first.
TEST(HostBlockStoreFairTest, WeightsSplitAFullStore) {
  auto store = *HostBlockStore::Create(40, kBlockBytes);
  ASSERT_TRUE(store->SetTenantWeight(11, 3).ok());
  for (int round = 0; round < 20; ++round) {
    PutTenantBlocks(*store, 11, NamespaceId(100 + round), 5, static_cast<uint32_t>(round));
    PutTenantBlocks(*store, 22, NamespaceId(200 + round), 5, static_cast<uint32_t>(round + 50));
  }
  EXPECT_EQ(store->stored_by(11) + store->stored_by(22), 40);
  EXPECT_NEAR(static_cast<double>(store->stored_by(11)), 30.0, 1.0);
  EXPECT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();
}

// Shares are bounded: tenants past max_shares (and untagged blocks) share the default order,
// whose weight cannot be set. Bad weights change nothing.
TEST(HostBlockStoreFairTest, TenantsPastTheSharesShareTheDefaultOrder) {
  auto store = *HostBlockStore::Create(8, kBlockBytes, 2);
  EXPECT_TRUE(store->SetTenantWeight(1, 2).ok());
  EXPECT_TRUE(store->SetTenantWeight(2, 1).ok());
  EXPECT_EQ(store->SetTenantWeight(3, 5).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store->SetTenantWeight(1, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->SetTenantWeight(1, 1'000'001).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store->SetTenantWeight(0, 1).code(), absl::StatusCode::kInvalidArgument);
  PutTenantBlocks(*store, 3, NamespaceId(3), 2, 3);
  PutTenantBlocks(*store, 4, NamespaceId(4), 2, 4);
  EXPECT_EQ(store->stored_by(3), 0);  // no share of its own: in the default one
  EXPECT_EQ(store->stored(), 4);
  EXPECT_EQ(HostBlockStore::Create(8, kBlockBytes, -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();
}

// A tenant share as the rule sees it, and the rule: the share that gives a block to make room is
// the one with the most blocks per unit of weight among those with an unpinned block, ties to the
// first listed (the share made first). 0: none can give.
struct ShareState {
  uint64_t tenant;
  int64_t stored;
  int64_t pinned;
  int32_t weight;
};
uint64_t ShareToGive(std::span<const ShareState> shares) {
  const ShareState* best = nullptr;
  for (const ShareState& s : shares) {
    if (s.stored - s.pinned <= 0) continue;
    if (best == nullptr || s.stored * best->weight > best->stored * s.weight) best = &s;
  }
  return best == nullptr ? 0 : best->tenant;
}

// Random puts, lookups, pins, unpins and invalidations by five tenants (the fifth past the
// shares, in the default one) with random weights, checked after every step: a Put with no free
// slot evicts from the share with the most blocks per unit of weight among those with an unpinned
// block (ties to the share made first, the default one before all), and the order stays whole.
TEST(HostBlockStoreFairTest, RandomLoadAlwaysEvictsFromTheShareMostOverItsWeight) {
  constexpr int64_t kCapacity = 24;
  constexpr uint64_t kPastShares = 5;
  auto store = *HostBlockStore::Create(kCapacity, kBlockBytes, 4);
  std::mt19937 rng(2026);
  std::map<uint64_t, int32_t> weight{{kPastShares, 1}};
  for (uint64_t t = 1; t <= 4; ++t) {
    weight[t] = 1 + static_cast<int32_t>(rng() % 4);
    ASSERT_TRUE(store->SetTenantWeight(t, weight[t]).ok());
  }
  struct Held {
    uint64_t tenant;
    NamespaceId ns;
    BlockHash hash;
  };
  struct Pin {
    HostBlockStore::Pins pins;
    uint64_t tenant;
    BlockHash hash;
    bool live;  // its block is still stored (not invalidated)
  };
  std::vector<Held> held;
  std::vector<Pin> pins;
  auto pinned = [&](uint64_t tenant) {
    int64_t n = 0;
    for (const Pin& p : pins) n += p.live && p.tenant == tenant ? 1 : 0;
    return n;
  };
  auto stored_by = [&](uint64_t tenant) {
    if (tenant != kPastShares) return store->stored_by(tenant);
    int64_t own = 0;
    for (uint64_t t = 1; t <= 4; ++t) own += store->stored_by(t);
    return store->stored() - own;
  };
  uint32_t seed = 100;
  int evictions_checked = 0;
  for (int step = 0; step < 4000; ++step) {
    const int dice = static_cast<int>(rng() % 10);
    const uint64_t tenant = 1 + rng() % 5;
    if (dice < 6) {
      int64_t dead = 0;  // invalidated while pinned: neither stored nor free
      for (const Pin& p : pins) dead += p.live ? 0 : 1;
      const bool full = store->stored() + dead == kCapacity;
      // Shares in the order they were made: the default one, then tenants 1..4.
      std::vector<ShareState> shares;
      for (const uint64_t t : {kPastShares, uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{4}}) {
        shares.push_back({t, stored_by(t), pinned(t), weight[t]});
      }
      const uint64_t expect = ShareToGive(shares);
      std::map<uint64_t, int64_t> before;
      for (uint64_t t = 1; t <= 5; ++t) before[t] = stored_by(t);
      const NamespaceId ns(1000 + step);
      held.push_back({tenant, ns, PutTenantBlocks(*store, tenant, ns, 1, seed++)[0]});
      for (uint64_t t = 1; t <= 5; ++t) {
        const int64_t change = (t == tenant ? 1 : 0) - (full && t == expect ? 1 : 0);
        ASSERT_EQ(stored_by(t), before[t] + change) << "step " << step << ", tenant " << t;
      }
      evictions_checked += full ? 1 : 0;
    } else if (dice < 8 && !held.empty()) {
      const Held& h = held[rng() % held.size()];
      const BlockSpace space{h.ns, kSpace.layout_fingerprint};
      const bool pinned_already =
          std::any_of(pins.begin(), pins.end(), [&](const Pin& p) { return p.hash == h.hash; });
      if (rng() % 2 == 0 || pinned_already || pins.size() >= 6) {
        auto one = Buffers(1);
        (void)store->Lookup(space, BlockHash{}, std::span(&h.hash, 1), Spans(one));
      } else {
        HostBlockStore::Pins p = store->LookupPinned(space, BlockHash{}, std::span(&h.hash, 1));
        if (p.size() == 1) pins.push_back({std::move(p), h.tenant, h.hash, true});
      }
    } else if (dice < 9 && !pins.empty()) {
      pins.erase(pins.begin() + static_cast<ptrdiff_t>(rng() % pins.size()));  // unpins
    } else if (rng() % 8 == 0) {
      store->Invalidate({.tenant = tenant});
      for (Pin& p : pins) p.live = p.live && p.tenant != tenant;
    }
    ASSERT_TRUE(store->CheckInvariants().ok())
        << "step " << step << ": " << store->CheckInvariants();
  }
  EXPECT_GT(evictions_checked, 1000);
}

// A lookup reads the slot after the previous hit before the index (a chain stored at once sits
// in consecutive slots). That slot counts only in use and stored under the parent asked for: here
// it keeps the key of a block invalidated while pinned, then follows a block of another chain.
TEST(HostBlockStoreTest, TheNextSlotCountsOnlyInUseAndUnderTheParentAsked) {
  auto store = *HostBlockStore::Create(4, kBlockBytes);
  const auto chain = MakeChain(kSpace, 2, kBlockBytes, 9);
  const auto other = MakeChain(kSpace, 1, kBlockBytes, 10);
  auto put = [&](const testing::TestChain& c, size_t i, uint64_t tenant) {
    ASSERT_TRUE(store->Put(kSpace, {.hash = c.hashes[i],
                                    .parent = i == 0 ? BlockHash{} : c.hashes[i - 1],
                                    .coverage = 16,
                                    .bytes = c.blocks[i],
                                    .tags = {.tenant = tenant, .model = 1}}));
  };
  auto hits = [&](std::span<const BlockHash> hashes) {
    auto buffers = Buffers(hashes.size());
    return store->Lookup(kSpace, BlockHash{}, hashes, Spans(buffers))->hits;
  };
  put(chain, 0, 1);  // slot 0
  put(chain, 1, 2);  // slot 1, after block 0
  ASSERT_EQ(hits(chain.hashes), 2);
  // Block 1 pinned and invalidated: out of the index, its slot out of use but not free.
  HostBlockStore::Pins pinned =
      store->LookupPinned(kSpace, chain.hashes[0], std::span(chain.hashes).subspan(1));
  ASSERT_EQ(pinned.size(), 1);
  EXPECT_EQ(store->Invalidate({.tenant = 2}), 1);
  EXPECT_EQ(hits(chain.hashes), 1);
  // Block 0 invalidated and put again: slot 0 once more, with slot 1 still holding block 1's key.
  EXPECT_EQ(store->Invalidate({.tenant = 1}), 1);
  put(chain, 0, 1);
  EXPECT_EQ(hits(chain.hashes), 1);
  pinned.Release();
  // Block 1 back (slot 1 again: the only free one below the unused), then block 0's slot given
  // to another chain's block: slot 1 follows it, but under another parent.
  put(chain, 1, 2);
  EXPECT_EQ(hits(chain.hashes), 2);
  EXPECT_EQ(store->Invalidate({.tenant = 1}), 1);
  put(other, 0, 3);
  const uint64_t corrupt = store->stats().corrupt;
  const std::vector<BlockHash> spliced = {other.hashes[0], chain.hashes[1]};
  EXPECT_EQ(hits(spliced), 1);
  EXPECT_EQ(store->stats().corrupt, corrupt + 1);  // block 1 is held, under another parent
  EXPECT_TRUE(store->CheckInvariants().ok());
}

// Random chains (branches sharing a stem, two namespaces, two tenants) put whole, in pieces or
// block by block in reverse, looked up and pinned from any block with the right or a wrong
// parent, unpinned and invalidated, in a store that evicts all the time. Every lookup gives what a
// model built from the listener says: the leading run stored under the parents asked for, byte
// for byte, and a corrupt count when the run stops at a block stored under another parent. A
// chain put at once sits in consecutive slots, and lookups read the slot after the previous hit
// before the index: slots reused by other blocks, emptied by an invalidation or holding the same
// hash under another chain must all miss that shortcut.
class HostBlockStoreChainsTest : public ::testing::Test {
 protected:
  struct Family {
    testing::TestChain chain;
    NamespaceTags tags;
  };
  // What the listener says is stored, by (namespace, layout, hash).
  using Ref = std::tuple<uint64_t, uint64_t, uint64_t, uint64_t>;
  struct Stored {
    BlockHash parent;
    std::vector<std::byte> bytes;
  };

  void SetUp() override {
    store_ = *HostBlockStore::Create(/*blocks=*/20, kBlockBytes, 2);
    MakeFamilies();
    store_->set_listener([this](const BlockSpace& space, const BlockHash& hash,
                                const BlockHash& parent, bool stored) {
      const Ref key = RefOf(space, hash);
      if (!stored) {
        ASSERT_EQ(model_.erase(key), 1u);
        return;
      }
      ASSERT_NE(putting_, nullptr);
      ASSERT_TRUE(
          model_.emplace(key, Stored{parent, putting_->chain.blocks[putting_index_]}).second);
    });
  }

  static Ref RefOf(const BlockSpace& space, const BlockHash& hash) {
    return Ref{space.ns.value(), space.layout_fingerprint, hash.lo, hash.hi};
  }

  // Eight chains of ten in two namespaces, each after the second sharing a stem of 1 to 6
  // blocks with the one two before it; one hash under two parents; and family 0's hashes under
  // another layout (another model's pool: the same tokens chain to the same hashes), with bytes
  // of their own.
  void MakeFamilies() {
    for (int f = 0; f < 8; ++f) {
      const BlockSpace space{NamespaceId(f % 2 == 0 ? 7 : 8), kSpace.layout_fingerprint};
      Family family{MakeChain(space, 10, kBlockBytes, 500 + static_cast<uint32_t>(f)),
                    {.tenant = 1 + static_cast<uint64_t>(f % 3 == 0), .model = 1}};
      if (f >= 2) {
        const Family& stem = families_[static_cast<size_t>(f - 2)];
        const size_t keep = 1 + rng_() % 6;
        for (size_t i = 0; i < keep; ++i) {
          family.chain.hashes[i] = stem.chain.hashes[i];
          family.chain.blocks[i] = stem.chain.blocks[i];
        }
        for (size_t i = keep; i < family.chain.hashes.size(); ++i) {
          const BlockHash& parent = family.chain.hashes[i - 1];
          family.chain.hashes[i] = BlockHash{parent.lo * 31 + i + static_cast<uint64_t>(f) * 977,
                                             parent.hi ^ (0x9E37 + static_cast<uint64_t>(f))};
        }
      }
      families_.push_back(std::move(family));
    }
    families_[7].chain.hashes[8] = families_[5].chain.hashes[8];
    Family other_layout = families_[0];
    other_layout.chain.space.layout_fingerprint += 1;
    for (auto& bytes : other_layout.chain.blocks) {
      for (std::byte& b : bytes) b = ~b;
    }
    families_.push_back(std::move(other_layout));
  }

  void Put(const Family& family, size_t i) {
    putting_ = &family;
    putting_index_ = i;
    (void)store_->Put(family.chain.space,
                      {.hash = family.chain.hashes[i],
                       .parent = i == 0 ? BlockHash{} : family.chain.hashes[i - 1],
                       .coverage = 16,
                       .bytes = family.chain.blocks[i],
                       .tags = family.tags});
    putting_ = nullptr;
  }

  // Puts blocks [from, to) of `family`, in order or in reverse.
  void PutRange(const Family& family, size_t from, size_t to, bool reversed) {
    if (!reversed) {
      for (size_t i = from; i < to; ++i) Put(family, i);
    } else {
      for (size_t i = to; i-- > from;) Put(family, i);
    }
  }

  // What a lookup of hashes [from, from + n) after `parent` should give: the hits, and whether
  // the run stops at a block held under another parent.
  std::pair<size_t, bool> Expect(const Family& family, size_t from, size_t n,
                                 BlockHash parent) const {
    size_t hits = 0;
    for (size_t i = from; i < from + n; ++i) {
      const auto it = model_.find(RefOf(family.chain.space, family.chain.hashes[i]));
      if (it == model_.end()) break;
      if (!(it->second.parent == parent)) return {hits, true};
      ++hits;
      parent = family.chain.hashes[i];
    }
    return {hits, false};
  }

  // Looks up (copying, or pinned and kept) hashes [from, from + n) of `family` after `parent`,
  // and checks the hits, their bytes and the corrupt count against the model. Returns the hits.
  size_t LookUp(const Family& family, size_t from, size_t n, BlockHash parent, bool pin) {
    const auto [hits, corrupt] = Expect(family, from, n, parent);
    const uint64_t corrupt_before = store_->stats().corrupt;
    const std::span<const BlockHash> asked = std::span(family.chain.hashes).subspan(from, n);
    if (!pin) {
      auto buffers = Buffers(n);
      const auto found = store_->Lookup(family.chain.space, parent, asked, Spans(buffers));
      EXPECT_TRUE(found.ok());
      EXPECT_EQ(found->hits, static_cast<int64_t>(hits));
      for (size_t i = 0; i < hits && i < static_cast<size_t>(found->hits); ++i) {
        EXPECT_EQ(buffers[i], family.chain.blocks[from + i]) << "block " << i;
      }
    } else {
      HostBlockStore::Pins p = store_->LookupPinned(family.chain.space, parent, asked);
      EXPECT_EQ(p.size(), static_cast<int64_t>(hits));
      for (size_t i = 0; i < hits && i < static_cast<size_t>(p.size()); ++i) {
        const std::span<const std::byte> bytes = p.block(i);
        EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), family.chain.blocks[from + i].begin()))
            << "pinned block " << i;
      }
      pins_.push_back(std::move(p));
    }
    EXPECT_EQ(store_->stats().corrupt - corrupt_before, corrupt ? 1u : 0u);
    return hits;
  }

  std::mt19937 rng_{31};
  std::unique_ptr<HostBlockStore> store_;
  std::vector<Family> families_;
  std::map<Ref, Stored> model_;
  const Family* putting_ = nullptr;  // whose Put the listener hears
  size_t putting_index_ = 0;
  std::vector<HostBlockStore::Pins> pins_;
};

TEST_F(HostBlockStoreChainsTest, RandomChainsLookUpAsTheListenerSaysTheyWereStored) {
  int64_t long_hits = 0;
  for (int step = 0; step < 20000; ++step) {
    SCOPED_TRACE(step);
    const Family& family = families_[rng_() % families_.size()];
    const size_t length = family.chain.hashes.size();
    const int dice = static_cast<int>(rng_() % 20);
    if (dice < 7) {
      const size_t from = rng_() % length;
      PutRange(family, from, from + 1 + rng_() % (length - from), /*reversed=*/dice >= 5);
    } else if (dice < 17) {
      const size_t from = rng_() % length;
      const size_t n = 1 + rng_() % (length - from);
      BlockHash parent = from == 0 ? BlockHash{} : family.chain.hashes[from - 1];
      if (rng_() % 8 == 0) parent = BlockHash{parent.lo + 1, parent.hi};  // the wrong one
      long_hits += LookUp(family, from, n, parent, /*pin=*/dice >= 12 && pins_.size() < 4) >= 3;
    } else if (dice < 19 && !pins_.empty()) {
      pins_.erase(pins_.begin() + static_cast<ptrdiff_t>(rng_() % pins_.size()));
    } else if (rng_() % 4 == 0) {
      store_->Invalidate({.tenant = 1 + rng_() % 2});
    }
    ASSERT_FALSE(HasFailure());
    ASSERT_TRUE(store_->CheckInvariants().ok()) << store_->CheckInvariants();
    ASSERT_EQ(store_->stored(), static_cast<int64_t>(model_.size()));
  }
  EXPECT_GT(long_hits, 400);  // runs long enough to take the shortcut, often
}

}  // namespace
}  // namespace kvpool::tier

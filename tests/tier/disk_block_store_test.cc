#include "tier/disk_block_store.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "tests/tier/test_chain.h"

namespace kvpool::tier {
namespace {

using testing::LookupBuffers;
using testing::MakeChain;
using testing::TestChain;

constexpr int64_t kBlockBytes = 8192;  // two pages: O_DIRECT reads straight into aligned buffers
constexpr uint64_t kLayout = 0x1234;
const BlockSpace kSpace{NamespaceId(7), kLayout};
const DeploymentSecret kSecret = DeploymentSecret::FromBytes(std::string(32, 's'));

class DiskBlockStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kvpool-disk-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  DiskTierOptions Options(int64_t blocks) const {
    return {.directory = dir_ + "/pool", .capacity_bytes = blocks * kBlockBytes};
  }
  std::unique_ptr<DiskBlockStore> Open(int64_t blocks = 16,
                                       const DeploymentSecret& secret = kSecret,
                                       uint64_t layout = kLayout, uint64_t content = 0) {
    DiskTierOptions options = Options(blocks);
    options.content_fingerprint = content;
    auto store = DiskBlockStore::Open(options, secret, layout, kBlockBytes);
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  }
  static void PutAll(DiskBlockStore& store, const TestChain& chain, NamespaceTags tags = {}) {
    for (size_t i = 0; i < chain.hashes.size(); ++i) {
      ASSERT_TRUE(store.Put(chain.space, {.hash = chain.hashes[i],
                                          .parent = i == 0 ? BlockHash{} : chain.hashes[i - 1],
                                          .coverage = 16,
                                          .bytes = chain.blocks[i],
                                          .tags = tags}));
    }
    ASSERT_TRUE(store.Flush(absl::Seconds(10)).ok());
  }
  // Hits of `chain` from its root, with the buffers overwritten first; each hit byte for byte.
  static int64_t Hits(DiskBlockStore& store, const TestChain& chain) {
    LookupBuffers out(static_cast<int>(chain.hashes.size()), kBlockBytes);
    for (auto& b : out.storage) std::fill(b.begin(), b.end(), std::byte{0xAA});
    auto found = store.Lookup(chain.space, BlockHash{}, chain.hashes, out.spans);
    EXPECT_TRUE(found.ok());
    for (int64_t i = 0; i < found->hits; ++i) {
      EXPECT_EQ(out.storage[static_cast<size_t>(i)], chain.blocks[static_cast<size_t>(i)]) << i;
    }
    EXPECT_TRUE(store.CheckInvariants().ok()) << store.CheckInvariants();
    return found->hits;
  }
  // Index entries on disk that are not all zero (a cleared slot's entry is zeroed).
  int64_t ReadIndexEntries() const {
    std::ifstream f(dir_ + "/pool/index.kvi", std::ios::binary);
    std::vector<char> entry(static_cast<size_t>(kIndexEntryBytes));
    int64_t live = 0;
    while (f.read(entry.data(), static_cast<std::streamsize>(entry.size()))) {
      live += std::any_of(entry.begin(), entry.end(), [](char c) { return c != 0; });
    }
    return live;
  }
  // Flips one byte of `file` at `offset`.
  void Flip(const std::string& file, int64_t offset) const {
    std::fstream f(dir_ + "/pool/" + file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(offset);
    char c = 0;
    f.read(&c, 1);
    f.seekp(offset);
    c = static_cast<char>(c ^ 0x5A);
    f.write(&c, 1);
  }

  std::string dir_;
};

TEST_F(DiskBlockStoreTest, ChainComesBackByteForByteAcrossAReopen) {
  const TestChain chain = MakeChain(kSpace, 6, kBlockBytes, 1);
  {
    auto store = Open();
    PutAll(*store, chain);
    EXPECT_EQ(Hits(*store, chain), 6);
    // Straight into page-aligned buffers too (the daemon's lookup buffers are).
    std::vector<internal::AlignedBuffer> aligned;
    std::vector<std::span<std::byte>> spans;
    for (int i = 0; i < 6; ++i) {
      aligned.push_back(*internal::AlignedBuffer::Create(kBlockBytes));
      spans.push_back(aligned.back().span());
    }
    EXPECT_EQ(store->Lookup(kSpace, BlockHash{}, chain.hashes, spans)->hits, 6);
    for (int i = 0; i < 6; ++i) {
      EXPECT_TRUE(std::equal(spans[i].begin(), spans[i].end(), chain.blocks[i].begin()));
    }
  }
  auto again = Open();
  EXPECT_EQ(again->disk_stats().recovered_blocks, 6);
  EXPECT_EQ(again->disk_stats().started_empty, "");
  EXPECT_EQ(Hits(*again, chain), 6);
  // Another namespace, layout or parent finds nothing.
  LookupBuffers out(1, kBlockBytes);
  EXPECT_EQ(
      again->Lookup({NamespaceId(8), kLayout}, BlockHash{}, {chain.hashes.data(), 1}, out.spans)
          ->hits,
      0);
  EXPECT_EQ(
      again->Lookup({kSpace.ns, kLayout + 1}, BlockHash{}, {chain.hashes.data(), 1}, out.spans)
          ->hits,
      0);
  EXPECT_EQ(again->Lookup(kSpace, BlockHash{1, 2}, {chain.hashes.data(), 1}, out.spans)->hits, 0);
}

// The records found at start are told each after its parent, whatever slots they sit in (here a
// chain stored leaf first, so the leaf took the first slot): a consumer that follows the events
// grows a tree from them, and skips a block whose parent it was not told of.
TEST_F(DiskBlockStoreTest, TheRecordsFoundAtStartAreToldEachAfterItsParent) {
  const TestChain chain = MakeChain(kSpace, 4, kBlockBytes, 7);
  {
    auto store = Open();
    for (size_t i = chain.hashes.size(); i-- > 0;) {
      ASSERT_TRUE(store->Put(chain.space, {.hash = chain.hashes[i],
                                           .parent = i == 0 ? BlockHash{} : chain.hashes[i - 1],
                                           .coverage = 16,
                                           .bytes = chain.blocks[i]}));
    }
    ASSERT_TRUE(store->Flush(absl::Seconds(10)).ok());
  }
  auto again = Open();
  std::vector<BlockHash> told;
  again->set_listener(
      [&](const BlockSpace& space, const BlockHash& hash, const BlockHash& parent, bool stored) {
        EXPECT_TRUE(stored);
        EXPECT_EQ(space.ns, kSpace.ns);
        EXPECT_EQ(parent, told.empty() ? BlockHash{} : told.back());
        told.push_back(hash);
      });
  again->TellRecords();
  EXPECT_EQ(told, chain.hashes);
}

TEST_F(DiskBlockStoreTest, BudgetSmallerThanTheWorkloadKeepsTheMostRecent) {
  auto store = Open(/*blocks=*/4);
  const TestChain chain = MakeChain(kSpace, 6, kBlockBytes, 2);
  PutAll(*store, chain);
  EXPECT_EQ(store->disk_stats().blocks, 4);
  EXPECT_EQ(store->disk_stats().evicted, 2u);
  EXPECT_EQ(Hits(*store, chain), 0);  // the chain's first blocks made room
  LookupBuffers out(4, kBlockBytes);
  const auto tail =
      store->Lookup(kSpace, chain.hashes[1], std::span(chain.hashes).subspan(2), out.spans);
  EXPECT_EQ(tail->hits, 4);
  EXPECT_EQ(out.storage[3], chain.blocks[5]);
}

TEST_F(DiskBlockStoreTest, TornOrTruncatedRecordsAreMissesNeverData) {
  const TestChain chain = MakeChain(kSpace, 4, kBlockBytes, 3);
  PutAll(*Open(), chain);
  Flip("blocks.kvd", 1 * kBlockBytes + 100);  // slot 1's payload
  {
    auto store = Open();
    EXPECT_EQ(Hits(*store, chain), 1);
    EXPECT_EQ(store->stats().corrupt, 1u);
    EXPECT_EQ(store->stats().forged, 1u);
    EXPECT_EQ(store->disk_stats().blocks, 3);  // dropped when it failed
  }
  // Cut the file inside slot 0: zeros past the end fail the MAC too.
  ASSERT_EQ(truncate((dir_ + "/pool/blocks.kvd").c_str(), kBlockBytes / 2), 0);
  auto store = Open();
  EXPECT_EQ(Hits(*store, chain), 0);
  EXPECT_EQ(store->stats().forged, 1u);
}

TEST_F(DiskBlockStoreTest, DamagedIndexEntriesAreDroppedAtScan) {
  const TestChain chain = MakeChain(kSpace, 3, kBlockBytes, 4);
  PutAll(*Open(), chain);
  Flip("index.kvi", 2 * kIndexEntryBytes + 20);  // slot 2's hash
  auto store = Open();
  EXPECT_EQ(store->disk_stats().scan_dropped, 1);
  EXPECT_EQ(store->disk_stats().recovered_blocks, 2);
  EXPECT_EQ(Hits(*store, chain), 2);
}

TEST_F(DiskBlockStoreTest, AnotherSecretLayoutModelOrVersionStartsEmpty) {
  const TestChain chain = MakeChain(kSpace, 2, kBlockBytes, 5);
  PutAll(*Open(), chain);
  const DeploymentSecret other = DeploymentSecret::FromBytes(std::string(32, 'o'));
  EXPECT_EQ(Open(16, other)->disk_stats().started_empty,
            "it was written under another deployment secret");
  PutAll(*Open(), chain);
  EXPECT_EQ(Open(16, kSecret, kLayout + 1)->disk_stats().started_empty,
            "it was written for another pool layout");
  PutAll(*Open(), chain);
  EXPECT_EQ(Open(16, kSecret, kLayout, 99)->disk_stats().started_empty,
            "it was written for another model");
  PutAll(*Open(), chain);
  // A superblock of a format this build does not read.
  Superblock future{.version = kDiskFormatVersion + 1};
  std::vector<std::byte> bytes(kSuperblockBytes);
  EncodeSuperblock(future, bytes);
  std::ofstream(dir_ + "/pool/tier.meta", std::ios::binary | std::ios::in)
      .write(reinterpret_cast<const char*>(bytes.data()), kSuperblockBytes);
  auto store = Open();
  EXPECT_NE(store->disk_stats().started_empty.find("incompatible kvpoold"), std::string::npos)
      << store->disk_stats().started_empty;
  EXPECT_EQ(store->disk_stats().blocks, 0);
  EXPECT_EQ(Hits(*store, chain), 0);
}

TEST_F(DiskBlockStoreTest, InvalidateDropsOnlyTheTaggedTenantAndStaysDroppedAfterAReopen) {
  const TestChain a = MakeChain(kSpace, 3, kBlockBytes, 6);
  const TestChain b = MakeChain({NamespaceId(9), kLayout}, 3, kBlockBytes, 7);
  {
    auto store = Open();
    PutAll(*store, a, {.tenant = 1, .model = 11});
    PutAll(*store, b, {.tenant = 2, .model = 22});
    EXPECT_EQ(store->Invalidate({.tenant = 1, .any_model = false, .model = 12}), 0);
    EXPECT_EQ(store->Invalidate({.tenant = 1}), 3);
    EXPECT_EQ(Hits(*store, a), 0);
    EXPECT_EQ(Hits(*store, b), 3);
    EXPECT_EQ(store->disk_stats().invalidated, 3u);
    ASSERT_TRUE(store->Flush(absl::Seconds(5)).ok());  // the cleared entries go down
  }
  auto store = Open();
  EXPECT_EQ(store->disk_stats().recovered_blocks, 3);
  EXPECT_EQ(Hits(*store, a), 0);
  EXPECT_EQ(Hits(*store, b), 3);
}

// Fair by tenant (as the host tier): a tenant writing five times the tier's budget evicts its own
// records, not another tenant's prefix, and after a reopen every record is back in its tenant's
// share (by the tags in its index entry), so the next flood still spares the prefix. With one
// order (tenant_shares 0) the prefix is gone.
TEST_F(DiskBlockStoreTest, AFloodingTenantEvictsItsOwnRecordsAcrossAReopen) {
  for (const int32_t shares : {16, 0}) {
    SCOPED_TRACE(shares);
    TearDown();
    SetUp();
    DiskTierOptions options = Options(10);
    options.tenant_shares = shares;
    const TestChain prefix = MakeChain(kSpace, 3, kBlockBytes, 1);
    auto flood = [&](DiskBlockStore& store, uint32_t seed) {
      for (uint32_t i = 0; i < 10; ++i) {
        PutAll(store, MakeChain({NamespaceId(100 + seed + i), kLayout}, 5, kBlockBytes, seed + i),
               {.tenant = 2, .model = 1});
      }
    };
    {
      auto store = *DiskBlockStore::Open(options, kSecret, kLayout, kBlockBytes);
      PutAll(*store, prefix, {.tenant = 1, .model = 1});
      flood(*store, 0);
      if (shares == 0) {
        EXPECT_EQ(Hits(*store, prefix), 0);
        continue;
      }
      EXPECT_EQ(Hits(*store, prefix), 3);
      EXPECT_EQ(store->stored_by(1), 3);
      EXPECT_EQ(store->stored_by(2), 7);
      EXPECT_EQ(store->evicted_from(2), 43u);
      EXPECT_EQ(store->evicted_from(1), 0u);
    }
    auto store = *DiskBlockStore::Open(options, kSecret, kLayout, kBlockBytes);
    EXPECT_EQ(store->stored_by(1), 3);
    EXPECT_EQ(store->stored_by(2), 7);
    flood(*store, 50);
    EXPECT_EQ(Hits(*store, prefix), 3);
    EXPECT_EQ(store->evicted_from(1), 0u);
  }
  DiskTierOptions bad = Options(10);
  bad.tenant_shares = -1;
  EXPECT_EQ(DiskBlockStore::Open(bad, kSecret, kLayout, kBlockBytes).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The entries an invalidation clears reach the disk before the store stops, and before a Flush
// returns: before, a store closed right after Invalidate (a daemon's shutdown) left them for the
// next start to find again, and Flush waited only for queued writes.
TEST_F(DiskBlockStoreTest, AnInvalidationSurvivesAStopRightAfterIt) {
  for (int round = 0; round < 5; ++round) {
    const TestChain a = MakeChain(kSpace, 3, kBlockBytes, 40 + static_cast<uint32_t>(round));
    {
      auto store = Open();
      PutAll(*store, a, {.tenant = 1, .model = 11});
      ASSERT_TRUE(store->Flush(absl::Seconds(5)).ok());  // written: stored records
      EXPECT_EQ(store->Invalidate({.tenant = 1}), 3);
    }  // stops at once
    auto store = Open();
    EXPECT_EQ(Hits(*store, a), 0) << "round " << round;
    PutAll(*store, a, {.tenant = 1, .model = 11});
    ASSERT_TRUE(store->Flush(absl::Seconds(5)).ok());
    EXPECT_EQ(store->Invalidate({.tenant = 1}), 3);
    ASSERT_TRUE(store->Flush(absl::Seconds(5)).ok());
    EXPECT_EQ(ReadIndexEntries(), 0) << "round " << round << ": Flush returned before the clears";
  }
}

// Holds the disk writer in its lock gap (DiskTierOptions::writer_gap_hook), or a lookup in its
// (lookup_gap_hook): once armed, the next to reach the gap waits there until Release.
class WriterLatch {
 public:
  void Arm() {
    absl::MutexLock lock(&mu_);
    armed_ = true;
  }
  void AwaitHeld() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&held_));
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    held_ = false;
  }
  void InGap() {
    absl::MutexLock lock(&mu_);
    if (!std::exchange(armed_, false)) return;
    held_ = true;
    mu_.Await(absl::Condition(
        +[](bool* held) { return !*held; }, &held_));
  }

 private:
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
};

// The writer's lock gap held open: it took its batch's slots under the lock (evicting the
// flooding tenant's own records), and writes the records without it. Meanwhile the store is
// consistent, the records being written are no hits, they count in their tenant's share, and an
// invalidation of their tenant drops them once written (never stored, never found after a
// reopen), while one of another tenant leaves them alone.
TEST_F(DiskBlockStoreTest, TheWritersLockGapHeldOpenKeepsEveryRule) {
  for (const uint64_t invalidated : {2, 1}) {
    SCOPED_TRACE(invalidated);
    TearDown();
    SetUp();
    WriterLatch latch;
    DiskTierOptions options = Options(9);
    options.writer_gap_hook = [&latch] { latch.InGap(); };
    const TestChain quiet = MakeChain(kSpace, 3, kBlockBytes, 1);
    const TestChain old = MakeChain({NamespaceId(20), kLayout}, 5, kBlockBytes, 2);
    const TestChain blocker = MakeChain({NamespaceId(30), kLayout}, 1, kBlockBytes, 3);
    const TestChain fresh = MakeChain({NamespaceId(21), kLayout}, 3, kBlockBytes, 4);
    int64_t expect_kept = 0;
    {
      auto store = *DiskBlockStore::Open(options, kSecret, kLayout, kBlockBytes);
      PutAll(*store, quiet, {.tenant = 1, .model = 1});
      PutAll(*store, old, {.tenant = 2, .model = 1});  // the store is full after the blocker
      // The blocker's batch waits in the gap while `fresh` is queued, so `fresh` is one batch.
      latch.Arm();
      ASSERT_TRUE(store->Put(blocker.space, {.hash = blocker.hashes[0],
                                             .coverage = 16,
                                             .bytes = blocker.blocks[0],
                                             .tags = {.tenant = 3, .model = 1}}));
      latch.AwaitHeld();
      for (size_t i = 0; i < fresh.hashes.size(); ++i) {
        ASSERT_TRUE(store->Put(fresh.space, {.hash = fresh.hashes[i],
                                             .parent = i == 0 ? BlockHash{} : fresh.hashes[i - 1],
                                             .coverage = 16,
                                             .bytes = fresh.blocks[i],
                                             .tags = {.tenant = 2, .model = 1}}));
      }
      latch.Arm();
      latch.Release();
      latch.AwaitHeld();  // `fresh` is in the gap: its three slots taken from `old`'s
      {
        absl::Cleanup release = [&latch] { latch.Release(); };
        EXPECT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();
        EXPECT_EQ(Hits(*store, fresh), 0);  // its bytes are not on disk yet
        EXPECT_EQ(Hits(*store, quiet), 3);
        EXPECT_EQ(store->stored_by(2), 5);  // two of `old` stored, three of `fresh` written
        EXPECT_EQ(store->evicted_from(2), 3u);
        EXPECT_EQ(store->evicted_from(1), 0u);
        EXPECT_EQ(store->Invalidate({.tenant = invalidated}), invalidated == 2 ? 2 : 3);
        EXPECT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();
      }
      ASSERT_TRUE(store->Flush(absl::Seconds(10)).ok());
      EXPECT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();
      EXPECT_EQ(Hits(*store, fresh), invalidated == 2 ? 0 : 3);
      EXPECT_EQ(Hits(*store, quiet), invalidated == 2 ? 3 : 0);
      EXPECT_EQ(Hits(*store, blocker), 1);
      EXPECT_EQ(store->stored_by(2), invalidated == 2 ? 0 : 5);
      EXPECT_EQ(store->disk_stats().invalidated, invalidated == 2 ? 5u : 3u);
      expect_kept = invalidated == 2 ? 4 : 6;
      EXPECT_EQ(ReadIndexEntries(), expect_kept);  // the dropped records' entries are cleared
    }
    options.writer_gap_hook = nullptr;
    auto store = *DiskBlockStore::Open(options, kSecret, kLayout, kBlockBytes);
    EXPECT_EQ(store->disk_stats().recovered_blocks, expect_kept);
    EXPECT_EQ(Hits(*store, fresh), invalidated == 2 ? 0 : 3);
  }
}

// A lookup's lock gap held open: it planned record R's slot, then R's tenant was invalidated and
// another record written into the freed slot before the lookup read it. The bytes it reads fail
// R's tag, but nothing was forged or damaged: a plain miss, not counted in corrupt or forged
// (the stats that signal tampering), and the new record stands. Before, the race counted a
// forgery and logged a drop that did not happen.
TEST_F(DiskBlockStoreTest, ASlotReusedDuringALookupIsAMissNotAForgery) {
  WriterLatch latch;
  DiskTierOptions options = Options(4);
  options.lookup_gap_hook = [&latch] { latch.InGap(); };
  const TestChain r = MakeChain(kSpace, 1, kBlockBytes, 60);
  const TestChain other = MakeChain({NamespaceId(8), kLayout}, 1, kBlockBytes, 61);
  auto store = *DiskBlockStore::Open(options, kSecret, kLayout, kBlockBytes);
  PutAll(*store, r, {.tenant = 1, .model = 1});
  latch.Arm();
  int64_t hits = -1;
  std::thread lookup([&] { hits = Hits(*store, r); });
  latch.AwaitHeld();
  {
    absl::Cleanup release = [&latch] { latch.Release(); };
    EXPECT_EQ(store->Invalidate({.tenant = 1}), 1);
    PutAll(*store, other, {.tenant = 2, .model = 1});  // the slot freed last is taken first
  }
  lookup.join();
  EXPECT_EQ(hits, 0);
  const RemoteTierStats stats = store->stats();
  EXPECT_EQ(stats.forged, 0u);
  EXPECT_EQ(stats.corrupt, 0u);
  EXPECT_EQ(stats.misses, 1u);
  EXPECT_EQ(Hits(*store, other), 1);
  EXPECT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();
}

// The writer clears the index entries of dropped records. A clearing that fails (EIO, EROFS) is
// counted as a failed write, told to the breaker and done again once the disk takes writes:
// meanwhile Flush does not report the entries cleared, and afterwards no invalidated record comes
// back at the next Open. Before, the writer forgot the failed entry and every one after it: Flush
// returned OK and a reopen found the invalidated records again.
TEST_F(DiskBlockStoreTest, AFailedClearingOfDroppedEntriesIsDoneAgain) {
  ManualClock clock;
  std::atomic<bool> failing{false};
  DiskTierOptions options = Options(8);
  options.breaker_backoff = absl::Milliseconds(10);
  options.clear_entry_fault = [&failing] {
    return failing ? absl::ErrnoToStatus(EIO, "injected") : absl::OkStatus();
  };
  const TestChain chain = MakeChain(kSpace, 3, kBlockBytes, 70);
  const TestChain later = MakeChain({NamespaceId(9), kLayout}, 1, kBlockBytes, 71);
  {
    auto store = *DiskBlockStore::Open(options, kSecret, kLayout, kBlockBytes, &clock);
    PutAll(*store, chain, {.tenant = 1, .model = 1});
    failing = true;
    EXPECT_EQ(store->Invalidate({.tenant = 1}), 3);
    // Tried again at once until three failures opened the breaker: nothing cleared, and Flush
    // says so.
    EXPECT_TRUE(absl::IsUnavailable(store->Flush(absl::Seconds(10))));
    EXPECT_EQ(store->disk_stats().write_errors, 3u);
    EXPECT_EQ(store->stats().breaker, BreakerState::kOpen);
    EXPECT_EQ(ReadIndexEntries(), 3);
    failing = false;
    clock.Advance(1'000'000'000);  // past the back-off: the writer probes, and clears
    PutAll(*store, later);         // its Flush waits for the clearing too
    EXPECT_EQ(store->stats().breaker, BreakerState::kClosed);
    EXPECT_EQ(ReadIndexEntries(), 1);
    EXPECT_TRUE(store->CheckInvariants().ok()) << store->CheckInvariants();
  }
  auto store = Open(8);
  EXPECT_EQ(store->disk_stats().recovered_blocks, 1);
  EXPECT_EQ(Hits(*store, chain), 0);
  EXPECT_EQ(Hits(*store, later), 1);
}

// A seeded mix of puts, lookups, invalidations and reopens against what was put: every hit is
// the bytes put under that name, and the invariants hold after every step.
TEST_F(DiskBlockStoreTest, RandomOperationsNeverReturnAWrongByte) {
  std::mt19937 rng(20240601);
  std::vector<TestChain> chains;
  for (uint32_t i = 0; i < 6; ++i) {
    chains.push_back(MakeChain({NamespaceId(1 + i % 3), kLayout}, 4, kBlockBytes, 100 + i));
  }
  auto store = Open(/*blocks=*/10);
  for (int step = 0; step < 60; ++step) {
    const TestChain& c = chains[rng() % chains.size()];
    switch (rng() % 5) {
      case 0:
      case 1:
        PutAll(*store, c, {.tenant = c.space.ns.value()});
        break;
      case 2:
        Hits(*store, c);  // checks the bytes of every hit
        break;
      case 3:
        store->Invalidate({.tenant = c.space.ns.value()});
        EXPECT_EQ(Hits(*store, c), 0);
        break;
      case 4:
        ASSERT_TRUE(store->Flush(absl::Seconds(5)).ok());
        store.reset();
        store = Open(/*blocks=*/10);
        break;
    }
    ASSERT_TRUE(store->CheckInvariants().ok()) << step << ": " << store->CheckInvariants();
  }
}

// Fills the file system under `dir` with a file of its own, leaving no space.
void FillUp(const std::string& dir) {
  std::ofstream filler(dir + "/filler", std::ios::binary);
  const std::string chunk(4096, 'x');
  while (filler.write(chunk.data(), chunk.size()) && filler.flush()) {
  }
}

// A file system that fills up under the store (another writer takes the space): its writes fail
// and are counted, lookups of what it holds still hit, nothing stalls or crashes; once space is
// back, writes succeed again. Needs CAP_SYS_ADMIN for a private tmpfs (skipped without it).
TEST_F(DiskBlockStoreTest, AFileSystemThatFillsUpIsCountedNeverFatal) {
  const std::string mnt = dir_ + "/mnt";
  std::filesystem::create_directory(mnt);
  if (mount("kvpool-test", mnt.c_str(), "tmpfs", 0, "size=256k") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here (" << strerror(errno) << ")";
  }
  DiskTierOptions options{.directory = mnt + "/pool", .capacity_bytes = 64 * kBlockBytes};
  options.breaker_failure_threshold = 1000;  // count every failure; the breaker is tested apart
  {
    auto store = *DiskBlockStore::Open(options, kSecret, kLayout, kBlockBytes);
    const TestChain chain = MakeChain(kSpace, 4, kBlockBytes, 8);
    PutAll(*store, chain);
    EXPECT_EQ(Hits(*store, chain), 4);
    FillUp(mnt);
    const TestChain more = MakeChain({NamespaceId(3), kLayout}, 8, kBlockBytes, 9);
    PutAll(*store, more);
    EXPECT_GT(store->disk_stats().write_errors, 0u);
    EXPECT_EQ(store->stats().dropped_write_errors, 8u);
    EXPECT_EQ(Hits(*store, more), 0);
    EXPECT_EQ(Hits(*store, chain), 4);  // what was there is still read
    std::filesystem::remove(mnt + "/filler");
    PutAll(*store, more);
    EXPECT_EQ(Hits(*store, more), 8);
  }
  umount2(mnt.c_str(), MNT_DETACH);
}

TEST_F(DiskBlockStoreTest, ABreakerStopsWritesOnAFailingDiskAndProbesAgain) {
  const std::string mnt = dir_ + "/mnt";
  std::filesystem::create_directory(mnt);
  if (mount("kvpool-test", mnt.c_str(), "tmpfs", 0, "size=256k") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here (" << strerror(errno) << ")";
  }
  ManualClock clock;
  DiskTierOptions options{.directory = mnt + "/pool", .capacity_bytes = 16 * kBlockBytes};
  options.write_batch_blocks = 1;
  options.breaker_failure_threshold = 2;
  {
    auto store = *DiskBlockStore::Open(options, kSecret, kLayout, kBlockBytes, &clock);
    FillUp(mnt);
    const TestChain chain = MakeChain(kSpace, 4, kBlockBytes, 10);
    for (size_t i = 0; i < 4; ++i) {
      EXPECT_TRUE(
          store->Put(kSpace, {.hash = chain.hashes[i], .coverage = 16, .bytes = chain.blocks[i]}));
      // The failed record's entry is not cleared while the disk fails: Flush says so.
      EXPECT_TRUE(absl::IsUnavailable(store->Flush(absl::Seconds(5))));
    }
    EXPECT_EQ(store->stats().breaker, BreakerState::kOpen);
    // Two failed writes (a record, or the clearing of the failed record's entry) opened it;
    // from then on nothing was tried.
    EXPECT_GE(store->stats().dropped_write_errors, 1u);
    EXPECT_GE(store->stats().dropped_breaker_open, 2u);
    EXPECT_EQ(store->stats().dropped_write_errors + store->stats().dropped_breaker_open, 4u);
    std::filesystem::remove(mnt + "/filler");
    clock.Advance(2'000'000'000);  // past the back-off: the next write probes, and succeeds
    PutAll(*store, chain);
    EXPECT_EQ(store->stats().breaker, BreakerState::kClosed);
    EXPECT_EQ(Hits(*store, chain), 4);
  }
  umount2(mnt.c_str(), MNT_DETACH);
}

}  // namespace
}  // namespace kvpool::tier

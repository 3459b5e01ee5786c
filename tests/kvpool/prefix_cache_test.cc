// Prefix cache behaviour through the KvCacheManager: sharing, partial coverage (both orderings
// of a rewind endpoint and its longer sibling), namespaces, eviction, events, explanations.

#include "kvpool/prefix_cache.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/tokens.h"

namespace kvpool {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

constexpr SessionId kAlice(1);
constexpr SessionId kBob(2);
constexpr NamespaceId kTenantA(100);
constexpr NamespaceId kTenantB(200);
constexpr int32_t kBs = 32;

// Tokens [start, start + n).
using test_tokens::Tokens;

std::vector<int32_t> Concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class PrefixCacheTest : public ::testing::Test {
 protected:
  void Make(int32_t num_blocks) {
    auto cache = KvCacheManager::Create({.block_size = kBs,
                                         .num_blocks = num_blocks,
                                         .max_blocks_per_seq = 64,
                                         .clock = &clock_,
                                         .epoch = 77,
                                         .event_capacity = 8});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }

  // Allocates `prompt` (+ `extra` tokens of room) and returns the result; plan in last_plan_.
  AllocateResult Alloc(const std::vector<int32_t>& prompt, int64_t extra = 0,
                       NamespaceId ns = kTenantA, SessionId session = kAlice, int priority = 0) {
    last_plan_ = DevicePlan{};
    absl::StatusOr<AllocateResult> r =
        cache_->Allocate(session,
                         {.ns = ns,
                          .num_tokens = static_cast<int64_t>(prompt.size()) + extra,
                          .prompt = prompt,
                          .priority = priority},
                         &last_plan_);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *r : AllocateResult{};
  }

  // Allocates, commits every prompt token and frees: what a served request leaves behind.
  void Serve(const std::vector<int32_t>& prompt, NamespaceId ns = kTenantA, int priority = 0) {
    const AllocateResult r = Alloc(prompt, 0, ns, kAlice, priority);
    ASSERT_TRUE(cache_->Free(kAlice, r.sequence, OnFree::kCommit).ok());
    ExpectInvariants();
  }

  const std::vector<BlockId>& Table(SequenceId id) { return cache_->Find(id)->table; }

  void ExpectInvariants() {
    const absl::Status status = cache_->CheckInvariants();
    ASSERT_TRUE(status.ok()) << status;
  }

  std::vector<KvEvent> Events(uint64_t from = 1) {
    std::vector<KvEvent> out;
    EXPECT_TRUE(cache_->events()->ReadFrom(from, 100, &out));
    return out;
  }

  ManualClock clock_;
  std::unique_ptr<KvCacheManager> cache_;
  DevicePlan last_plan_;
};

// The journal a tier writer drains: every full block that becomes cached, once, parents first,
// with the chained hashes the events carry; partial blocks and re-publishes are not in it.
TEST(PublishJournalTest, ListsEachNewlyCachedFullBlockOnce) {
  ManualClock clock;
  auto made = KvCacheManager::Create({.block_size = kBs,
                                      .num_blocks = 16,
                                      .max_blocks_per_seq = 64,
                                      .clock = &clock,
                                      .publish_journal = true});
  ASSERT_TRUE(made.ok()) << made.status();
  KvCacheManager& cache = **made;
  std::vector<PublishedBlock> journal;
  cache.TakePublished(&journal);
  EXPECT_THAT(journal, IsEmpty());

  DevicePlan plan;
  const std::vector<int32_t> prompt = Tokens(0, 2 * kBs + 5);  // two full blocks and a tail
  auto a =
      cache.Allocate(kAlice, {.ns = kTenantA, .num_tokens = 2 * kBs + 5, .prompt = prompt}, &plan);
  ASSERT_TRUE(a.ok());
  const std::vector<BlockId> table = cache.Find(a->sequence)->table;
  ASSERT_TRUE(cache.Free(kAlice, a->sequence, OnFree::kCommit).ok());
  cache.TakePublished(&journal);
  ASSERT_THAT(journal, SizeIs(2));
  const BlockHash h0 = PrefixChainHash({}, kTenantA, std::span(prompt).first(kBs));
  const BlockHash h1 = PrefixChainHash(h0, kTenantA, std::span(prompt).subspan(kBs, kBs));
  EXPECT_EQ(journal[0].block, table[0]);
  EXPECT_EQ(journal[0].hash, h0);
  EXPECT_EQ(journal[0].parent, BlockHash{});
  EXPECT_EQ(journal[0].ns, kTenantA);
  EXPECT_EQ(journal[1].block, table[1]);
  EXPECT_EQ(journal[1].hash, h1);
  EXPECT_EQ(journal[1].parent, h0);
  cache.TakePublished(&journal);
  EXPECT_THAT(journal, IsEmpty());  // drained

  // The same prompt again adds nothing new; one more full block adds exactly that block.
  const std::vector<int32_t> longer = Tokens(0, 3 * kBs);
  auto b = cache.Allocate(kBob, {.ns = kTenantA, .num_tokens = 3 * kBs, .prompt = longer}, &plan);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(cache.Free(kBob, b->sequence, OnFree::kCommit).ok());
  cache.TakePublished(&journal);
  ASSERT_THAT(journal, SizeIs(1));
  EXPECT_EQ(journal[0].parent, h1);
  EXPECT_EQ(journal[0].hash,
            PrefixChainHash(h1, kTenantA, std::span(longer).subspan(2 * kBs, kBs)));
}

TEST(PublishJournalTest, OffByDefault) {
  ManualClock clock;
  auto cache = *KvCacheManager::Create(
      {.block_size = kBs, .num_blocks = 8, .max_blocks_per_seq = 8, .clock = &clock});
  DevicePlan plan;
  const std::vector<int32_t> prompt = Tokens(0, kBs);
  auto a = cache->Allocate(kAlice, {.ns = kTenantA, .num_tokens = kBs, .prompt = prompt}, &plan);
  ASSERT_TRUE(cache->Free(kAlice, a->sequence, OnFree::kCommit).ok());
  std::vector<PublishedBlock> journal(3);
  cache->TakePublished(&journal);
  EXPECT_THAT(journal, IsEmpty());
}

TEST_F(PrefixCacheTest, ServedPromptIsSharedByReference) {
  Make(32);
  const std::vector<int32_t> prompt = Tokens(0, 100);  // 3 full blocks + 4 tokens
  const AllocateResult a = Alloc(prompt);
  EXPECT_EQ(a.matched_tokens, 0);
  const std::vector<BlockId> blocks = Table(a.sequence);
  ASSERT_TRUE(cache_->Free(kAlice, a.sequence, OnFree::kCommit).ok());
  EXPECT_EQ(cache_->pool().num_cached(), 4);
  ExpectInvariants();

  const AllocateResult b = Alloc(prompt, /*extra=*/0, kTenantA, kBob);
  EXPECT_EQ(b.matched_tokens, 100);
  EXPECT_EQ(Table(b.sequence), blocks);  // the very same blocks
  EXPECT_TRUE(last_plan_.empty());       // nothing to copy or fill
  EXPECT_EQ(cache_->pool().num_cached(), 0);
  EXPECT_EQ(cache_->pool().refs(blocks[0]), 2u);  // Bob's + the tree's
  ExpectInvariants();

  // A prompt diverging inside block 2 reuses blocks 0-1 and the first 10 tokens of block 2,
  // through a copy since it writes the rest of that block.
  const std::vector<int32_t> diverged = Concat(Tokens(0, 74), Tokens(5000, 30));
  const AllocateResult c = Alloc(diverged);
  EXPECT_EQ(c.matched_tokens, 74);
  EXPECT_EQ(Table(c.sequence)[1], blocks[1]);
  ASSERT_THAT(last_plan_.copies, SizeIs(1));
  EXPECT_EQ(last_plan_.copies[0].src, blocks[2]);
  EXPECT_EQ(last_plan_.copies[0].dst, Table(c.sequence)[2]);
  ExpectInvariants();
  EXPECT_EQ(cache_->stats().hit_tokens, 174u);
}

// The rewind endpoint (16 of 32 tokens) is cached first; a longer sibling arrives later, in a
// block of its own: the endpoint's block is then redundant and dropped, and the endpoint stays
// reusable through the wider block.
TEST_F(PrefixCacheTest, RewindEndpointSurvivesALongerSiblingCreatedAfter) {
  Make(32);
  const AllocateResult longer = Alloc(Tokens(0, 64));  // allocated before the endpoint exists
  Serve(Tokens(0, 48));  // block 0 + a partial node covering 16 tokens of block 1
  EXPECT_EQ(cache_->stats().cache.nodes, 2);
  EXPECT_EQ(cache_->MatchPrefix(kTenantA, Tokens(0, 48)), 48);

  ASSERT_TRUE(cache_->Free(kAlice, longer.sequence, OnFree::kCommit).ok());
  EXPECT_EQ(cache_->stats().cache.dominated, 1u);
  EXPECT_EQ(cache_->MatchPrefix(kTenantA, Tokens(0, 48)), 48);  // still reusable
  EXPECT_EQ(cache_->MatchPrefix(kTenantA, Tokens(0, 40)), 40);
  EXPECT_EQ(cache_->MatchPrefix(kTenantA, Tokens(0, 64)), 64);
  ExpectInvariants();
}

// Same order, but the longer prompt is allocated after the endpoint: it adopts the endpoint's
// block, writes above its 16 published tokens in place, and its commit widens that node.
TEST_F(PrefixCacheTest, RewindEndpointIsWidenedByTheSequenceThatExtendsIt) {
  Make(32);
  Serve(Tokens(0, 48));
  const AllocateResult r = Alloc(Tokens(0, 64));
  EXPECT_EQ(r.matched_tokens, 48);
  EXPECT_TRUE(last_plan_.copies.empty());
  ASSERT_TRUE(cache_->Free(kAlice, r.sequence, OnFree::kCommit).ok());
  EXPECT_EQ(cache_->stats().cache.nodes, 2);
  EXPECT_EQ(cache_->stats().cache.widened, 1u);
  EXPECT_EQ(cache_->MatchPrefix(kTenantA, Tokens(0, 48)), 48);
  EXPECT_EQ(cache_->MatchPrefix(kTenantA, Tokens(0, 64)), 64);
  ExpectInvariants();
}

// The longer sibling is cached first; the rewind endpoint is committed later.
TEST_F(PrefixCacheTest, RewindEndpointSurvivesALongerSiblingCreatedBefore) {
  Make(32);
  Serve(Tokens(0, 64));
  Serve(Tokens(0, 48));  // covered by the full block: nothing new is inserted
  EXPECT_EQ(cache_->stats().cache.nodes, 2);
  EXPECT_EQ(cache_->stats().cache.inserted, 2u);
  const AllocateResult r = Alloc(Tokens(0, 48));
  EXPECT_EQ(r.matched_tokens, 48);
  EXPECT_TRUE(last_plan_.empty());  // it reads 16 tokens of the full block, writes nothing
  ExpectInvariants();
}

TEST_F(PrefixCacheTest, BlockCoveringTooFewTokensIsNeverAdoptedForMore) {
  Make(32);
  Serve(Tokens(0, 48));                                // partial node: 16 tokens of block 1
  const AllocateResult holder = Alloc(Tokens(0, 48));  // another holder of that block
  // A prompt needing all 32 tokens of block 1 gets the 16 the node covers, not 32, and computes
  // tokens 48..63 into a copy (the block is shared, so it cannot write into it).
  const AllocateResult r = Alloc(Tokens(0, 64));
  EXPECT_EQ(r.matched_tokens, 48);
  ASSERT_THAT(last_plan_.copies, SizeIs(1));
  EXPECT_EQ(last_plan_.copies[0].src, Table(holder.sequence)[1]);
  EXPECT_EQ(last_plan_.copies[0].dst, Table(r.sequence)[1]);
  const MatchExplanation why = cache_->ExplainMatch(kTenantA, Tokens(0, 64));
  EXPECT_EQ(why.stop, MatchStop::kInsufficientCoverage);
  EXPECT_EQ(why.best_coverage, 16);
  EXPECT_EQ(why.tokens_needed, 32);
  EXPECT_THAT(why.ToString(), HasSubstr("covers only 16 of the 32"));
  ExpectInvariants();
}

// Every prompt token Allocate does not find is counted once, under why its match stopped: the
// reasons add up to prompt_tokens - hit_tokens.
TEST_F(PrefixCacheTest, MissedTokensAreCountedByWhyTheMatchStopped) {
  Make(32);
  Serve(Tokens(0, 48));                                // nothing cached yet: 48 not cached
  EXPECT_EQ(Alloc(Tokens(0, 48)).matched_tokens, 48);  // all found; it holds the partial node
  const AllocateResult wider = Alloc(Tokens(0, 64));   // block 1 covers 16 of 32: 16 coverage
  EXPECT_EQ(wider.matched_tokens, 48);
  // The default policy keeps a block seen once on probation (AdmissionFilter): evicted there,
  // it was below the admission bar.
  Serve(Tokens(1000, 64));                               // a new chain: 64 not cached
  ASSERT_EQ(cache_->EvictCached(64), 2);                 // only that chain is unlocked
  EXPECT_EQ(Alloc(Tokens(1000, 64)).matched_tokens, 0);  // 64 below the admission bar
  // A chain hit once is admitted: evicted after that, its miss is an eviction's.
  Serve(Tokens(2000, 64));                               // 64 not cached
  Serve(Tokens(2000, 64));                               // hit: admitted
  ASSERT_EQ(cache_->EvictCached(64), 2);                 // only that chain is unlocked
  EXPECT_EQ(Alloc(Tokens(2000, 64)).matched_tokens, 0);  // 64 evicted
  const KvCacheStats s = cache_->stats();
  EXPECT_EQ(s.missed_not_cached, 48u + 64u + 64u);
  EXPECT_EQ(s.missed_coverage, 16u);
  EXPECT_EQ(s.missed_below_admission_bar, 64u);
  EXPECT_EQ(s.missed_evicted, 64u);
  EXPECT_EQ(
      s.missed_not_cached + s.missed_coverage + s.missed_evicted + s.missed_below_admission_bar,
      s.prompt_tokens - s.hit_tokens);
  ExpectInvariants();
}

// A miss at the prompt's first block whose tokens another namespace holds counts as
// another_namespace; it is only counted: the match in the caller's namespace finds nothing.
TEST_F(PrefixCacheTest, MissesOfAPrefixAnotherNamespaceHoldsAreCountedSo) {
  Make(32);
  Serve(Tokens(0, 64), kTenantA);                                     // 64 not cached
  EXPECT_EQ(Alloc(Tokens(0, 64), 0, kTenantB).matched_tokens, 0);     // B has no tree: another's
  Serve(Tokens(5000, 64), kTenantB);                                  // 64 not cached
  EXPECT_EQ(Alloc(Tokens(0, 64), 0, kTenantB).matched_tokens, 0);     // B's differs: another's
  EXPECT_EQ(Alloc(Tokens(9000, 64), 0, kTenantB).matched_tokens, 0);  // nobody's: not cached
  const KvCacheStats s = cache_->stats();
  EXPECT_EQ(s.missed_another_namespace, 128u);
  EXPECT_EQ(s.missed_not_cached, 192u);
  EXPECT_EQ(s.missed_not_cached + s.missed_another_namespace + s.missed_coverage +
                s.missed_evicted + s.missed_below_admission_bar,
            s.prompt_tokens - s.hit_tokens);
  EXPECT_TRUE(cache_->ExplainMatch(kTenantB, Tokens(0, 64)).first_block_elsewhere);
  EXPECT_FALSE(cache_->ExplainMatch(kTenantB, Tokens(9000, 64)).first_block_elsewhere);
  EXPECT_FALSE(cache_->ExplainMatch(kTenantA, Tokens(0, 64)).first_block_elsewhere);  // a hit
  // Evicted everywhere, it is nobody's any more.
  ASSERT_GT(cache_->EvictCached(64), 0);
  EXPECT_FALSE(cache_->ExplainMatch(kTenantB, Tokens(0, 64)).first_block_elsewhere);
  ExpectInvariants();
}

TEST_F(PrefixCacheTest, ExactBlockBoundaryMatchIgnoresStalePartialBlocks) {
  Make(32);
  Serve(Tokens(0, 48));
  // Keep the partial node in use so the full sibling cannot drop it.
  const AllocateResult holder = Alloc(Tokens(0, 48));
  Serve(Tokens(0, 64));
  EXPECT_EQ(cache_->stats().cache.nodes, 3);  // block 0, the partial node, the full block 1

  const AllocateResult boundary = Alloc(Tokens(0, 32));
  EXPECT_EQ(boundary.matched_tokens, 32);
  EXPECT_THAT(Table(boundary.sequence), SizeIs(1));  // no stale partial block appended
  const AllocateResult full = Alloc(Tokens(0, 64));
  EXPECT_EQ(full.matched_tokens, 64);
  EXPECT_NE(Table(full.sequence)[1],
            Table(holder.sequence)[1]);  // the full block, not the stale one
  ExpectInvariants();
}

TEST_F(PrefixCacheTest, NamespacesNeverShareAPrefix) {
  Make(32);
  Serve(Tokens(0, 64), kTenantA);
  const AllocateResult other = Alloc(Tokens(0, 64), 0, kTenantB);
  EXPECT_EQ(other.matched_tokens, 0);
  ASSERT_TRUE(cache_->Free(kAlice, other.sequence, OnFree::kCommit).ok());
  // Identical tokens, two trees, two sets of blocks.
  EXPECT_EQ(cache_->stats().cache.nodes, 4);
  const MatchExplanation why = cache_->ExplainMatch(NamespaceId(300), Tokens(0, 64));
  EXPECT_EQ(why.stop, MatchStop::kUnknownNamespace);
  EXPECT_THAT(why.other_namespaces,
              ElementsAre(std::pair(kTenantA, int64_t{64}), std::pair(kTenantB, int64_t{64})));
  ExpectInvariants();
}

TEST_F(PrefixCacheTest, PartialCommitThenDecodeWritesInPlaceAndWidens) {
  Make(32);
  const AllocateResult r = Alloc(Tokens(0, 40), /*extra=*/100);
  ASSERT_TRUE(cache_->Commit(kAlice, r.sequence, 40).ok());  // block 1 published with 8 tokens
  const BlockId block1 = Table(r.sequence)[1];
  EXPECT_EQ(cache_->cache()->CoverageOf(block1), 8);
  DevicePlan plan;
  // Decoding writes slot 8 onwards: above what was published, so in place.
  ASSERT_TRUE(cache_->Truncate(kAlice, r.sequence, 41).ok());
  ASSERT_TRUE(cache_->Grow(kAlice, r.sequence, 48, &plan).ok());
  EXPECT_TRUE(plan.copies.empty());
  ASSERT_TRUE(cache_->Commit(kAlice, r.sequence, 48, Tokens(40, 8)).ok());
  EXPECT_EQ(cache_->cache()->CoverageOf(block1), 16);
  EXPECT_EQ(cache_->stats().cache.widened, 1u);
  EXPECT_THAT(Events(), SizeIs(1));  // block 0 only: partial blocks are not announced
  ASSERT_TRUE(cache_->Grow(kAlice, r.sequence, 64, &plan).ok());
  ASSERT_TRUE(cache_->Commit(kAlice, r.sequence, 64, Tokens(48, 16)).ok());
  EXPECT_EQ(cache_->cache()->CoverageOf(block1), 32);
  const std::vector<KvEvent> events = Events();
  ASSERT_THAT(events, SizeIs(2));
  EXPECT_EQ(events[1].type, KvEventType::kBlockStored);
  EXPECT_EQ(events[1].token_ids, Tokens(32, 32));
  EXPECT_EQ(events[1].parent_hash, events[0].block_hashes[0]);
  ExpectInvariants();
}

TEST_F(PrefixCacheTest, RewritingBelowPublishedTokensCopiesFirst) {
  Make(32);
  const AllocateResult r = Alloc(Tokens(0, 64), /*extra=*/32);
  ASSERT_TRUE(cache_->Commit(kAlice, r.sequence, 64).ok());
  const BlockId published = Table(r.sequence)[1];
  ASSERT_TRUE(cache_->Truncate(kAlice, r.sequence, 40).ok());  // rewind into block 1
  DevicePlan plan;
  ASSERT_TRUE(cache_->Grow(kAlice, r.sequence, 41, &plan).ok());
  ASSERT_THAT(plan.copies, SizeIs(1));  // the cached tokens 40..63 must survive
  EXPECT_EQ(plan.copies[0].src, published);
  EXPECT_EQ(cache_->MatchPrefix(kTenantA, Tokens(0, 64)), 64);
  ExpectInvariants();
}

TEST_F(PrefixCacheTest, EvictsLeastRecentlyReleasedLeavesAndNeverLockedOnes) {
  Make(6);
  Serve(Tokens(0, 64));                                 // 2 blocks, released first
  Serve(Tokens(1000, 64));                              // 2 blocks
  const AllocateResult held = Alloc(Tokens(2000, 64));  // 2 blocks in use
  EXPECT_EQ(cache_->pool().num_free(), 0);
  // Needs 2 blocks: the oldest chain goes, leaf first.
  const AllocateResult fresh = Alloc(Tokens(3000, 64));
  EXPECT_EQ(fresh.matched_tokens, 0);
  EXPECT_EQ(cache_->MatchPrefix(kTenantA, Tokens(0, 64)), 0);
  EXPECT_EQ(cache_->MatchPrefix(kTenantA, Tokens(1000, 64)), 64);
  EXPECT_EQ(cache_->stats().evictions, 2u);
  const MatchExplanation why = cache_->ExplainMatch(kTenantA, Tokens(0, 64));
  EXPECT_EQ(why.stop, MatchStop::kEvicted);
  const std::vector<KvEvent> events = Events();
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().type, KvEventType::kBlockRemoved);
  EXPECT_THAT(events.back().block_hashes, SizeIs(2));

  // Everything left is in use or locked: a call that needs more fails and changes nothing.
  const AllocateResult reuse = Alloc(Tokens(1000, 64));  // locks the last cached chain
  const std::string before = cache_->DebugString();
  DevicePlan plan;
  const absl::StatusOr<AllocateResult> no_room =
      cache_->Allocate(kAlice, {.ns = kTenantA, .num_tokens = 1}, &plan);
  EXPECT_EQ(no_room.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(GetShortfall(no_room.status())->resource, Resource::kPoolBlocks);
  EXPECT_EQ(cache_->DebugString(), before);
  ExpectInvariants();
  (void)held;
  (void)reuse;
}

TEST_F(PrefixCacheTest, LowPriorityIsEvictedFirst) {
  Make(4);
  Serve(Tokens(0, 64), kTenantA, /*priority=*/2);  // a system prompt, say
  Serve(Tokens(1000, 64), kTenantA, /*priority=*/0);
  Alloc(Tokens(2000, 64));  // needs two blocks
  EXPECT_EQ(cache_->MatchPrefix(kTenantA, Tokens(0, 64)), 64);
  EXPECT_EQ(cache_->MatchPrefix(kTenantA, Tokens(1000, 64)), 0);
}

TEST_F(PrefixCacheTest, EventsAreGapFreeAndLateConsumersGetASnapshot) {
  Make(32);
  for (int i = 0; i < 12; ++i) Serve(Tokens(i * 100, 32));
  const EventLog& log = *cache_->events();
  EXPECT_EQ(log.epoch(), 77u);
  EXPECT_EQ(log.next_seq(), 13u);
  std::vector<KvEvent> out;
  EXPECT_FALSE(log.ReadFrom(1, 100, &out));  // the ring keeps 8: events 1-4 are gone
  EXPECT_TRUE(out.empty());
  ASSERT_TRUE(log.ReadFrom(5, 100, &out));
  ASSERT_THAT(out, SizeIs(8));
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(out[i].seq, 5 + i);
    EXPECT_EQ(out[i].epoch, 77u);
  }
  uint64_t resume = 0;
  const std::vector<KvEvent> snapshot = cache_->SnapshotEvents(&resume);
  EXPECT_EQ(resume, 13u);
  EXPECT_THAT(snapshot, SizeIs(12));
  ASSERT_TRUE(cache_->ClearCache().ok());
  out.clear();
  ASSERT_TRUE(log.ReadFrom(13, 100, &out));
  ASSERT_THAT(out, SizeIs(1));
  EXPECT_EQ(out[0].type, KvEventType::kAllBlocksCleared);
  EXPECT_EQ(cache_->pool().num_free(), 32);
  ExpectInvariants();
}

TEST_F(PrefixCacheTest, ClearRefusesWhileBlocksAreInUse) {
  Make(8);
  Serve(Tokens(0, 64));
  const AllocateResult r = Alloc(Tokens(0, 64));
  EXPECT_EQ(cache_->ClearCache().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(cache_->Free(kAlice, r.sequence).ok());
  EXPECT_TRUE(cache_->ClearCache().ok());
}

TEST_F(PrefixCacheTest, ExplainNamesWhereAPromptDiverged) {
  Make(32);
  Serve(Tokens(0, 64));
  const MatchExplanation diverged =
      cache_->ExplainMatch(kTenantA, Concat(Tokens(0, 40), Tokens(9, 24)));
  EXPECT_EQ(diverged.matched_tokens, 40);
  EXPECT_EQ(diverged.stop, MatchStop::kDiverged);
  EXPECT_EQ(diverged.block_index, 1);
  EXPECT_EQ(diverged.best_common, 8);
  const MatchExplanation beyond = cache_->ExplainMatch(kTenantA, Tokens(0, 96));
  EXPECT_EQ(beyond.stop, MatchStop::kNoChild);
  EXPECT_EQ(beyond.matched_tokens, 64);
  EXPECT_EQ(cache_->ExplainMatch(kTenantA, Tokens(0, 64)).stop, MatchStop::kPromptEnd);
}

TEST_F(PrefixCacheTest, ForkedSequencesFollowTheirParentsPath) {
  Make(32);
  Serve(Tokens(0, 64));
  const AllocateResult r = Alloc(Tokens(0, 64), /*extra=*/8);
  DevicePlan plan;
  const absl::StatusOr<SequenceId> child = cache_->Fork(kAlice, r.sequence, &plan);
  ASSERT_TRUE(child.ok());
  ExpectInvariants();  // every path node locked once per sequence following it
  ASSERT_TRUE(cache_->Free(kAlice, r.sequence).ok());
  EXPECT_EQ(cache_->EvictCached(10), 0);  // the child still holds the chain
  ASSERT_TRUE(cache_->Free(kAlice, *child).ok());
  EXPECT_EQ(cache_->EvictCached(10), 2);
  ExpectInvariants();
}

// Issue 12: a node with thousands of children (a root under many distinct prompts) must not make
// partial-block lookups, commits or removals scan them all. Only the children sharing the
// block's first token are compared.
TEST_F(PrefixCacheTest, ThousandsOfChildrenKeepLookupsAndRemovalsShort) {
  constexpr int32_t kChildren = 3000;
  Make(2 * kChildren + 64);
  auto prompt = [](int32_t i) { return Tokens(1'000'000 + i * 100, kBs + 5); };
  for (int32_t i = 0; i < kChildren; ++i) {
    const AllocateResult r = Alloc(prompt(i));
    ASSERT_TRUE(cache_->Free(kAlice, r.sequence, OnFree::kCommit).ok());
  }
  // Siblings sharing a first token, differing after it.
  for (int32_t i = 0; i < 20; ++i) {
    const AllocateResult r = Alloc(Concat({7}, Tokens(5'000'000 + i * 100, kBs)));
    ASSERT_TRUE(cache_->Free(kAlice, r.sequence, OnFree::kCommit).ok());
  }
  ExpectInvariants();
  const uint64_t before = cache_->cache()->stats().child_scans;

  // Exact and partial lookups among 3,020 children of the root.
  const AllocateResult exact = Alloc(prompt(1234));
  EXPECT_EQ(exact.matched_tokens, kBs + 5);
  const AllocateResult diverged =
      Alloc(Concat(Tokens(1'000'000 + 2345 * 100, 10), Tokens(-99, 30)));
  EXPECT_EQ(diverged.matched_tokens, 10);
  const AllocateResult shared = Alloc(Concat({7}, Concat(Tokens(5'000'000 + 13 * 100, 4), {-5})));
  EXPECT_EQ(shared.matched_tokens, 5);
  // Commit a diverging sibling (and its dominated-sibling check) under the wide root.
  ASSERT_TRUE(cache_->Free(kAlice, diverged.sequence, OnFree::kCommit).ok());
  ASSERT_TRUE(cache_->Free(kAlice, shared.sequence, OnFree::kCommit).ok());
  const uint64_t scans = cache_->cache()->stats().child_scans - before;
  // The 21 children starting with token 7 are compared, a few times over; the other 3,000 never.
  EXPECT_LE(scans, 100u) << "partial lookups scanned the root's children";
  ExpectInvariants();

  // Removal: evicting every child leaves the root's index empty and consistent.
  ASSERT_TRUE(cache_->Free(kAlice, exact.sequence, OnFree::kDiscard).ok());
  EXPECT_GT(cache_->EvictCached(1'000'000), 2 * kChildren);
  ExpectInvariants();
  EXPECT_EQ(cache_->cache()->stats().nodes, 0);
}

// Full children are found by comparing token hashes in place while a parent has few, and through
// the child index once it turns wide (the index then takes in the children it already had); a
// parent that lost them all is narrow again and its new children are found in place.
TEST_F(PrefixCacheTest, FullChildrenAreFoundBeforeAndAfterTheParentTurnsWide) {
  Make(64);
  const std::vector<int32_t> stem = Tokens(0, kBs);
  auto prompt = [&](int32_t i) { return Concat(stem, Tokens(10'000 + i * 100, kBs)); };
  auto serve_all = [&](int32_t from, int32_t to) {
    for (int32_t i = from; i < to; ++i) Serve(prompt(i));
  };
  auto expect_all_cached = [&](int32_t from, int32_t to) {
    for (int32_t i = from; i < to; ++i) {
      const AllocateResult r = Alloc(prompt(i));
      EXPECT_EQ(r.matched_tokens, 2 * kBs) << "child " << i;
      ASSERT_TRUE(cache_->Free(kAlice, r.sequence, OnFree::kCommit).ok());
    }
    ExpectInvariants();
  };
  serve_all(0, 8);  // 8 full children of the stem: narrow
  expect_all_cached(0, 8);
  serve_all(8, 12);  // the 9th turns the stem wide
  expect_all_cached(0, 12);
  const AllocateResult hold = Alloc(stem);  // keeps the stem while its children go
  ASSERT_EQ(hold.matched_tokens, kBs);
  ASSERT_EQ(cache_->EvictCached(1'000), 12);
  ExpectInvariants();
  serve_all(20, 23);
  expect_all_cached(20, 23);
  EXPECT_EQ(cache_->cache()->stats().nodes, 4);
  ASSERT_TRUE(cache_->Free(kAlice, hold.sequence, OnFree::kCommit).ok());
}

TEST_F(PrefixCacheTest, CommitRejectsBadInputAndChangesNothing) {
  Make(8);
  const AllocateResult r = Alloc(Tokens(0, 40), /*extra=*/10);
  const std::string before = cache_->DebugString();
  EXPECT_EQ(cache_->Commit(kAlice, r.sequence, 51).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Commit(kAlice, r.sequence, 45).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Commit(kAlice, r.sequence, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Commit(kAlice, r.sequence, 40, Tokens(0, 11)).code(),
            absl::StatusCode::kInvalidArgument);  // more tokens than the sequence holds
  EXPECT_EQ(cache_->Commit(kBob, r.sequence, 40).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(cache_->Commit(kAlice, SequenceId(99), 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_->DebugString(), before);
  DevicePlan plan;
  EXPECT_EQ(
      cache_->Allocate(kAlice, {.ns = kTenantA, .num_tokens = 3, .prompt = Tokens(0, 4)}, &plan)
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->Allocate(kAlice, {.ns = kTenantA, .num_tokens = 3, .priority = 9}, &plan)
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool

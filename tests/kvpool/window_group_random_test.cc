// Seeded randomized test of the window group (docs/hybrid-groups.md §3, §4) against a reference
// model: a KvCacheManager with a small window group beside its prefix cache, driven by random
// Allocate and Grow (window blocks for all their tokens, or only a few ahead: window_ahead), steps
// (ExtendWindow where the window table does not reach yet, then compute every token not computed
// yet or a chunk of them, then MarkWindowInFlight and SlideWindow), SlideWindow to earlier points,
// Fork, Truncate, Commit, Free (discard and commit), EvictCached, fences completed across timelines
// and ReclaimRetired, and a tier loader's import (Allocate with no window blocks, ImportWindow,
// the tier's bytes copied in, Commit, Free: the daemon's Promotion).
//
// The window blocks' bytes are simulated: each token slot holds the (position, token) a step
// wrote there, plans' copies and fills land at once, and every query a step computes reads its
// window and sinks and checks each key is the sequence's own token at that position. So a block
// released too early, shared without a copy-on-write, kept in the tree for the wrong block, or a
// match that resumes past a tombstone, shows up as data. A block handed out (fill or copy target)
// must have every fence it was marked with passed.
// After every operation: CheckInvariants(), the code the model predicts, which entries of every
// window table are live (the reference's), the bound after a slide, and a resumed sequence's
// match against the reference's longest resumable prefix; and the events a consumer read so far
// (the window group's blocks as group 1) agree with a snapshot. Even seeds run under a namespace
// quota charged in bytes, window blocks included: no operation may take the charge past it.
//
// Seeds divisible by 3 put the namespace in an eviction share of its own (the share's charges are
// checked with the invariants). KVPOOL_WINDOW_RANDOM_OPS=N runs N operations per seed instead of
// the default.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/event_mirror.h"
#include "tests/kvpool/timeline_fences.h"

namespace kvpool {
namespace {

using Code = absl::StatusCode;

constexpr int32_t kBlockSize = 4;
constexpr int32_t kMaxBlocksPerSeq = 24;
constexpr int32_t kNumBlocks = 96;
constexpr int32_t kWindowBlocks = 22;
constexpr int32_t kFamilies = 3;
constexpr size_t kMaxSequences = 8;
constexpr int32_t kFamilyTokens = kMaxBlocksPerSeq * kBlockSize;
constexpr uint32_t kTimelines = 2;
constexpr SessionId kSessions[] = {SessionId(1), SessionId(2)};
constexpr NamespaceId kNamespace(7);
constexpr int64_t kBlockBytes = 4;
constexpr int64_t kWindowBlockBytes = 12;
constexpr int64_t kQuotaBlocks = 100;

struct Config {
  uint64_t seed;
  int32_t window;
  int32_t sinks;
};

void PrintTo(const Config& c, std::ostream* os) {
  *os << "seed " << c.seed << ", W " << c.window << ", S " << c.sinks;
}

// What a token slot of a window block holds: the position and token a step wrote there.
int64_t Key(int64_t position, int32_t token) { return position * 1000 + token; }
constexpr int64_t kGarbage = -7;  // a fresh block's bytes: never a key

struct Model {
  SessionId session;
  std::vector<int32_t> tokens;  // every token's id, num_tokens of them
  int64_t known = 0;            // tokens the manager knows (prompt and commits)
  int64_t computed = 0;         // tokens whose KV a step wrote
  int64_t first_live = 0;       // entries [sinks, first_live) are released
  int64_t entries = 0;          // window entries allocated (window_ahead, ExtendWindow)
};

struct Tally {
  int64_t resumes = 0;           // Allocates that resumed a cached prefix
  int64_t window_cuts = 0;       // ... whose match the window group cut
  int64_t refusals = 0;          // calls refused for want of window blocks
  int64_t quota_refusals = 0;    // ... of which by the namespace's quota
  int64_t truncate_refused = 0;  // Truncates refused below the released window
  int64_t slid = 0;              // entries released by slides
  int64_t steps = 0;
  int64_t lagging = 0;  // steps that had to extend the window table first
  int64_t imports = 0;  // tier loaders that imported window blocks and committed
};

class WindowGroupRandomTest : public ::testing::TestWithParam<Config> {
 protected:
  void SetUp() override {
    const Config& c = GetParam();
    rng_.seed(c.seed);
    window_ = c.window;
    sinks_ = c.sinks;
    auto m = KvCacheManager::Create({.block_size = kBlockSize,
                                     .num_blocks = kNumBlocks,
                                     .max_blocks_per_seq = kMaxBlocksPerSeq,
                                     .fences = &fences_,
                                     .eviction_shares = c.seed % 3 == 0 ? 2 : 0,
                                     .window_blocks = kWindowBlocks,
                                     .window_tokens = window_,
                                     .sink_tokens = sinks_,
                                     .block_bytes = kBlockBytes,
                                     .window_block_bytes = kWindowBlockBytes});
    ASSERT_TRUE(m.ok()) << m.status();
    manager_ = std::move(*m);
    // Half the seeds run under a quota that binds often: the namespace's blocks and window blocks
    // are charged their bytes (a window block three blocks' worth), and no call may take them
    // past it (checked after every operation). The other half leave the window group's own
    // bound to refuse.
    if (c.seed % 2 == 0) {
      ASSERT_TRUE(manager_->SetNamespaceQuota(kNamespace, kQuotaBlocks).ok());
    }
    // A third of them with the namespace in an eviction share of its own (fair eviction): window
    // blocks are charged to it, and window-group pressure picks its victims by share.
    if (c.seed % 3 == 0) {
      ASSERT_TRUE(manager_->SetEvictionShare(kNamespace, 5).ok());
    }
    bytes_.assign(kWindowBlocks, std::vector<int64_t>(kBlockSize, kGarbage));
    marks_.assign(kWindowBlocks, std::vector<uint64_t>(kTimelines, 0));
    for (auto& family : families_) {
      family.resize(kFamilyTokens);
      for (int32_t& t : family) t = static_cast<int32_t>(Rand(3));
    }
  }

  uint64_t Rand(uint64_t n) { return std::uniform_int_distribution<uint64_t>(0, n - 1)(rng_); }
  int64_t SinkBlocks() const { return (sinks_ + kBlockSize - 1) / kBlockSize; }
  int64_t BlocksFor(int64_t n) const { return (n + kBlockSize - 1) / kBlockSize; }
  int64_t WindowStart(int64_t n) const {
    return std::max<int64_t>(0, n - window_ + 1) / kBlockSize;
  }
  bool Needs(int64_t i, int64_t n) const {
    return i < BlocksFor(n) && (i < SinkBlocks() || i >= WindowStart(n));
  }
  const Sequence& Seq(SequenceId id) const { return *manager_->Find(id); }
  void Refused(const absl::Status& status) {
    ++tally_.refusals;
    const std::optional<Shortfall> why = GetShortfall(status);
    tally_.quota_refusals += why && why->resource == Resource::kNamespaceQuota ? 1 : 0;
  }
  SequenceId Pick() {
    auto it = models_.begin();
    std::advance(it, static_cast<ptrdiff_t>(Rand(models_.size())));
    return it->first;
  }

  // The device side of a plan: copies and fills land now; their blocks are marked in flight.
  void Apply(const DevicePlan& plan) {
    std::vector<BlockId> touched;
    for (const BlockCopy& c : plan.window_copies) {
      HandOut(c.dst);
      bytes_[Index(c.dst)] = bytes_[Index(c.src)];
      touched.insert(touched.end(), {c.src, c.dst});
    }
    for (const BlockFill& f : plan.window_fills) {
      HandOut(f.block);
      bytes_[Index(f.block)].assign(kBlockSize, kGarbage);
      touched.push_back(f.block);
    }
    Mark(touched);
  }
  static size_t Index(BlockId b) { return static_cast<size_t>(b.value()); }
  void HandOut(BlockId b) {
    for (uint32_t t = 0; t < kTimelines; ++t) {
      ASSERT_LE(marks_[Index(b)][t], fences_.completed(t))
          << "window block " << b.value() << " handed out before its fence on timeline " << t;
      marks_[Index(b)][t] = 0;
    }
  }
  void Mark(const std::vector<BlockId>& blocks) {
    if (blocks.empty()) return;
    const uint32_t t = static_cast<uint32_t>(Rand(kTimelines));
    if (fences_.Outstanding(t) >= 3) fences_.Complete(t, fences_.completed(t) + 1);
    const Fence fence = fences_.Issue(t);
    ASSERT_TRUE(manager_->MarkWindowInFlight(blocks, fence).ok());
    for (BlockId b : blocks) marks_[Index(b)][t] = fence.value;
  }

  // The reference's longest resumable prefix of `prompt`: the attention match, or the deepest
  // block boundary below it whose window and sinks the tree keeps.
  int64_t Resumable(std::span<const int32_t> prompt) const {
    const PrefixMatch m = manager_->cache()->Match(kNamespace, prompt);
    std::map<int32_t, int32_t> kept;  // tree block -> window block
    std::istringstream in(manager_->DebugString());
    for (std::string line; std::getline(in, line);) {
      int block = 0, primary = 0;
      unsigned long long stamp = 0;
      if (std::sscanf(line.c_str(), "window block=%d primary=%d stamp=%llu", &block, &primary,
                      &stamp) == 3) {
        kept[primary] = block;
      }
    }
    const auto block_at = [&](int64_t i) {
      return (static_cast<size_t>(i) < m.full.size() ? m.full[static_cast<size_t>(i)] : m.partial)
          .value();
    };
    for (int64_t p = m.matched_tokens; p > 0; p = (p - 1) / kBlockSize * kBlockSize) {
      bool ok = true;
      for (int64_t i = 0; i < BlocksFor(p) && ok; ++i)
        ok = !Needs(i, p) || kept.contains(block_at(i));
      if (ok) return p;
    }
    return 0;
  }

  // Every entry's liveness is the reference's, and live ones name distinct-enough blocks.
  void CheckTables() {
    for (const auto& [id, model] : models_) {
      const Sequence& seq = Seq(id);
      ASSERT_EQ(seq.num_tokens, static_cast<int64_t>(model.tokens.size()));
      ASSERT_EQ(static_cast<int64_t>(seq.window_table.size()), model.entries);
      ASSERT_LE(seq.window_table.size(), seq.table.size());
      for (size_t i = 0; i < seq.window_table.size(); ++i) {
        const bool live =
            static_cast<int64_t>(i) < SinkBlocks() || static_cast<int64_t>(i) >= model.first_live;
        ASSERT_EQ(seq.window_table[i] != kInvalidBlock, live)
            << "sequence " << id.value() << " entry " << i << " first_live " << model.first_live;
      }
    }
  }

  // A random window_ahead: all (-1) or a few tokens.
  int64_t Ahead() { return Rand(2) == 0 ? -1 : static_cast<int64_t>(Rand(9)); }
  // The window entries a request for `n` tokens allocates from `from` on with `ahead`.
  int64_t EntriesFor(int64_t n, int64_t from, int64_t ahead) const {
    return BlocksFor(ahead < 0 || ahead >= n ? n : std::min(n, from + ahead));
  }

  // A step: computes the tokens past `computed` (all of them, or a chunk), each query reading
  // its window and sinks, after taking the window blocks they need (ExtendWindow).
  void Step(SequenceId id) {
    Model& model = models_.at(id);
    const int64_t size = static_cast<int64_t>(model.tokens.size());
    const int64_t end =
        Rand(2) == 0 || model.computed >= size
            ? size
            : model.computed + 1 +
                  static_cast<int64_t>(Rand(static_cast<uint64_t>(size - model.computed)));
    if (BlocksFor(end) > model.entries) {
      DevicePlan plan;
      const absl::Status s = manager_->ExtendWindow(model.session, id, end, &plan);
      if (!s.ok()) {
        ASSERT_EQ(s.code(), Code::kResourceExhausted) << s;
        Refused(s);
        return;
      }
      Apply(plan);
      model.entries = BlocksFor(end);
      ++tally_.lagging;
    }
    const Sequence& seq = Seq(id);
    for (int64_t p = model.computed; p < end; ++p) {
      const BlockId w = seq.window_table[static_cast<size_t>(p / kBlockSize)];
      ASSERT_NE(w, kInvalidBlock) << "position " << p;
      bytes_[Index(w)][static_cast<size_t>(p % kBlockSize)] =
          Key(p, model.tokens[static_cast<size_t>(p)]);
      for (int64_t q = 0; q <= p; ++q) {
        if (q >= sinks_ && q < p - window_ + 1) continue;
        const BlockId r = seq.window_table[static_cast<size_t>(q / kBlockSize)];
        ASSERT_NE(r, kInvalidBlock) << "query " << p << " reads released key " << q;
        ASSERT_EQ(bytes_[Index(r)][static_cast<size_t>(q % kBlockSize)],
                  Key(q, model.tokens[static_cast<size_t>(q)]))
            << "sequence " << id.value() << " query " << p << " key " << q << " in window block "
            << r.value();
      }
    }
    std::vector<BlockId> live;
    for (BlockId b : seq.window_table) {
      if (b != kInvalidBlock) live.push_back(b);
    }
    Mark(live);
    model.computed = std::max(model.computed, end);
    Slide(id, model.computed);
    int64_t now = 0;
    for (BlockId b : Seq(id).window_table) now += b != kInvalidBlock ? 1 : 0;
    if (end == size) {
      ASSERT_LE(now, manager_->WindowBound()) << "after a slide to its length";
    }
    ++tally_.steps;
  }

  void Slide(SequenceId id, int64_t n) {
    Model& model = models_.at(id);
    const int64_t before = model.first_live;
    ASSERT_TRUE(manager_->SlideWindow(model.session, id, n).ok());
    const int64_t size = model.entries;
    model.first_live = std::max(before, std::max(SinkBlocks(), std::min(WindowStart(n), size)));
    tally_.slid += model.first_live - before;
  }

  void Allocate();
  void Grow();
  void Fork();
  void Truncate();
  void Commit();
  void Free();
  void Import();

  std::mt19937_64 rng_;
  int32_t window_ = 0;
  int32_t sinks_ = 0;
  testing::TimelineFences fences_;
  std::unique_ptr<KvCacheManager> manager_;
  std::vector<std::vector<int64_t>> bytes_;   // [window block][token slot]
  std::vector<std::vector<uint64_t>> marks_;  // [window block][timeline]: last fence marked
  std::array<std::vector<int32_t>, kFamilies> families_;
  std::map<SequenceId, Model> models_;
  Tally tally_;
  EventMirror mirror_{/*grouped=*/true};
};

void WindowGroupRandomTest::Allocate() {
  const auto& family = families_[Rand(kFamilies)];
  const int64_t len = static_cast<int64_t>(Rand(kFamilyTokens / 2));
  std::vector<int32_t> prompt(family.begin(), family.begin() + len);
  if (len > 0 && Rand(3) == 0) prompt[Rand(static_cast<uint64_t>(len))] = 9;  // diverges
  const int64_t n = len + static_cast<int64_t>(Rand(6));
  const SessionId session = kSessions[Rand(2)];
  const int64_t expect = Resumable(prompt);
  const int64_t attention = manager_->cache()->Match(kNamespace, prompt).matched_tokens;
  DevicePlan plan;
  const int64_t ahead = Ahead();
  const absl::StatusOr<AllocateResult> r = manager_->Allocate(
      session, {.ns = kNamespace, .num_tokens = n, .prompt = prompt, .window_ahead = ahead}, &plan);
  if (!r.ok()) {
    ASSERT_EQ(r.status().code(), Code::kResourceExhausted) << r.status();
    Refused(r.status());
    return;
  }
  ASSERT_EQ(r->matched_tokens, expect) << "attention match " << attention;
  tally_.resumes += expect > 0 ? 1 : 0;
  tally_.window_cuts += expect < attention ? 1 : 0;
  Apply(plan);
  Model model{.session = session, .tokens = prompt, .known = len, .computed = expect};
  for (int64_t p = len; p < n; ++p) {
    model.tokens.push_back(Rand(4) != 0 ? family[static_cast<size_t>(p)] : 9);
  }
  model.first_live = std::max(SinkBlocks(), expect > 0 ? WindowStart(expect) : 0);
  model.entries = std::max(EntriesFor(n, expect, ahead), BlocksFor(expect));
  models_.emplace(r->sequence, std::move(model));
  // The resumed window names blocks holding exactly the prompt's tokens.
  const Sequence& seq = Seq(r->sequence);
  for (int64_t q = 0; q < expect; ++q) {
    if (!Needs(q / kBlockSize, expect)) continue;
    ASSERT_EQ(bytes_[Index(seq.window_table[static_cast<size_t>(q / kBlockSize)])]
                    [static_cast<size_t>(q % kBlockSize)],
              Key(q, prompt[static_cast<size_t>(q)]))
        << "resumed key " << q;
  }
}

void WindowGroupRandomTest::Grow() {
  const SequenceId id = Pick();
  Model& model = models_.at(id);
  const int64_t n = std::min<int64_t>(
      static_cast<int64_t>(model.tokens.size()) + 1 + static_cast<int64_t>(Rand(6)),
      kMaxBlocksPerSeq * kBlockSize);
  DevicePlan plan;
  const int64_t ahead = Ahead();
  const GrowRequest grow{id, n, ahead};
  const absl::Status s = manager_->GrowBatch(model.session, std::span(&grow, 1), &plan);
  if (!s.ok()) {
    ASSERT_EQ(s.code(), Code::kResourceExhausted) << s;
    Refused(s);
    return;
  }
  Apply(plan);
  model.entries =
      std::max(model.entries, EntriesFor(n, static_cast<int64_t>(model.tokens.size()), ahead));
  while (static_cast<int64_t>(model.tokens.size()) < n) {
    model.tokens.push_back(static_cast<int32_t>(Rand(3)));
  }
}

void WindowGroupRandomTest::Fork() {
  const SequenceId id = Pick();
  const Model parent = models_.at(id);
  DevicePlan plan;
  const absl::StatusOr<SequenceId> child = manager_->Fork(parent.session, id, &plan);
  if (!child.ok()) {
    ASSERT_EQ(child.status().code(), Code::kResourceExhausted) << child.status();
    Refused(child.status());
    return;
  }
  Apply(plan);
  models_.emplace(*child, parent);
}

void WindowGroupRandomTest::Truncate() {
  const SequenceId id = Pick();
  Model& model = models_.at(id);
  const int64_t n = static_cast<int64_t>(Rand(model.tokens.size() + 1));
  bool refuse = false;
  for (int64_t i = 0; i < BlocksFor(n); ++i) {
    refuse |= Needs(i, n) && i >= SinkBlocks() && i < model.first_live;
  }
  const absl::Status s = manager_->Truncate(model.session, id, n);
  if (refuse) {
    ASSERT_EQ(s.code(), Code::kFailedPrecondition) << s;
    ++tally_.truncate_refused;
    return;
  }
  ASSERT_TRUE(s.ok()) << s;
  model.tokens.resize(static_cast<size_t>(n));
  model.known = std::min(model.known, n);
  model.computed = std::min(model.computed, n);
  model.first_live = std::max(SinkBlocks(), std::min(model.first_live, BlocksFor(n)));
  model.entries = std::min(model.entries, BlocksFor(n));
}

void WindowGroupRandomTest::Commit() {
  const SequenceId id = Pick();
  Model& model = models_.at(id);
  if (model.computed < model.known) return;  // only tokens whose KV is written are published
  const std::span<const int32_t> fresh(model.tokens.data() + model.known,
                                       static_cast<size_t>(model.computed - model.known));
  const absl::Status s = manager_->Commit(model.session, id, model.computed, fresh);
  ASSERT_TRUE(s.ok()) << s;
  model.known = model.computed;
}

void WindowGroupRandomTest::Free() {
  const SequenceId id = Pick();
  const Model& model = models_.at(id);
  const bool commit = model.computed >= model.known && Rand(2) == 0;
  const absl::Status s =
      manager_->Free(model.session, id, commit ? OnFree::kCommit : OnFree::kDiscard);
  ASSERT_TRUE(s.ok()) << s;
  models_.erase(id);
}

// A tier loader (daemon/engine/promotion.cc): a prompt's full blocks with no window blocks
// (window_ahead 0), fresh ones for exactly what the window at its end reads past the match
// (ImportWindow), filled with those tokens' keys as a tier that kept them would, then Commit and
// Free. Later resumes read what the tree kept of it as data.
void WindowGroupRandomTest::Import() {
  const auto& family = families_[Rand(kFamilies)];
  const int64_t len = kBlockSize * (1 + static_cast<int64_t>(Rand(kMaxBlocksPerSeq / 2)));
  const std::vector<int32_t> prompt(family.begin(), family.begin() + len);
  const SessionId session = kSessions[Rand(2)];
  // Uncut (AllocateRequest::adopt_uncut) it adopts the whole attention match and imports every
  // entry its window reads that the tree does not keep; else it resumes where the reference says.
  const bool uncut = Rand(2) == 0;
  const int64_t expect =
      uncut ? manager_->cache()->Match(kNamespace, prompt).matched_tokens : Resumable(prompt);
  DevicePlan plan;
  const absl::StatusOr<AllocateResult> r = manager_->Allocate(session,
                                                              {.ns = kNamespace,
                                                               .num_tokens = len,
                                                               .prompt = prompt,
                                                               .window_ahead = 0,
                                                               .adopt_uncut = uncut},
                                                              &plan);
  if (!r.ok()) {
    ASSERT_EQ(r.status().code(), Code::kResourceExhausted) << r.status();
    Refused(r.status());
    return;
  }
  ASSERT_EQ(r->matched_tokens, expect);
  Apply(plan);
  ASSERT_TRUE(plan.window_fills.empty());
  const SequenceId id = r->sequence;
  if (expect % kBlockSize != 0) {  // the rest of that block is nobody's to fill: not promoted
    ASSERT_TRUE(manager_->Free(session, id).ok());
    return;
  }
  const absl::StatusOr<std::vector<std::pair<int64_t, BlockId>>> imported =
      manager_->ImportWindow(session, id);
  if (!imported.ok()) {
    ASSERT_EQ(imported.status().code(), Code::kResourceExhausted) << imported.status();
    Refused(imported.status());
    ASSERT_EQ(Seq(id).window_table.size(),  // unchanged
              static_cast<size_t>(uncut ? 0 : BlocksFor(expect)));
    ASSERT_TRUE(manager_->Free(session, id).ok());
    return;
  }
  std::vector<BlockId> copied;
  size_t next = 0;
  for (int64_t i = uncut ? 0 : BlocksFor(expect); i < BlocksFor(len); ++i) {
    if (!Needs(i, len)) continue;
    // Uncut, an entry whose block the tree keeps a window block beside takes that one (the
    // check below reads it as data); past a cut match no entry's block is the tree's.
    if (uncut && (next == imported->size() || (*imported)[next].first != i)) continue;
    ASSERT_LT(next, imported->size()) << "entry " << i << " is read and was not imported";
    const auto [entry, block] = (*imported)[next++];
    ASSERT_EQ(entry, i);
    ASSERT_EQ(Seq(id).window_table[static_cast<size_t>(i)], block);
    HandOut(block);
    for (int64_t p = i * kBlockSize; p < (i + 1) * kBlockSize; ++p) {
      bytes_[Index(block)][static_cast<size_t>(p % kBlockSize)] =
          Key(p, prompt[static_cast<size_t>(p)]);
    }
    copied.push_back(block);
  }
  ASSERT_EQ(next, imported->size()) << "an entry the window does not read was imported";
  Mark(copied);
  // Its window at its end is whole: adopted entries and imported ones.
  const std::vector<BlockId>& table = Seq(id).window_table;
  ASSERT_EQ(table.size(), static_cast<size_t>(BlocksFor(len)));
  for (int64_t q = 0; q < len; ++q) {
    const BlockId w = table[static_cast<size_t>(q / kBlockSize)];
    ASSERT_EQ(w != kInvalidBlock, Needs(q / kBlockSize, len)) << "entry " << q / kBlockSize;
    if (w != kInvalidBlock) {
      ASSERT_EQ(bytes_[Index(w)][static_cast<size_t>(q % kBlockSize)],
                Key(q, prompt[static_cast<size_t>(q)]));
    }
  }
  ASSERT_TRUE(manager_->Commit(session, id, len, {}).ok());
  ASSERT_TRUE(manager_->Free(session, id).ok());
  ++tally_.imports;
}

TEST_P(WindowGroupRandomTest, MatchesTheReferenceModel) {
  int64_t ops = 3000;
  if (const char* env = std::getenv("KVPOOL_WINDOW_RANDOM_OPS")) ops = std::atoll(env);
  for (int64_t op = 0; op < ops; ++op) {
    SCOPED_TRACE(::testing::Message() << "op " << op);
    uint64_t kind = models_.empty() ? 0 : Rand(21);
    // At most kMaxSequences live: an Allocate or Fork becomes a Free.
    if (models_.size() >= kMaxSequences && (kind < 4 || kind == 12)) kind = 15;
    if (kind < 4) {
      Allocate();
    } else if (kind < 7) {
      Grow();
    } else if (kind < 11) {
      Step(Pick());
    } else if (kind < 12) {
      const SequenceId id = Pick();
      Slide(id, static_cast<int64_t>(Rand(static_cast<uint64_t>(models_.at(id).computed) + 1)));
    } else if (kind < 13) {
      Fork();
    } else if (kind < 14) {
      Truncate();
    } else if (kind < 15) {
      Commit();
    } else if (kind < 17) {
      Free();
    } else if (kind < 18) {
      manager_->EvictCached(static_cast<int64_t>(1 + Rand(4)));
    } else if (kind < 20) {
      const uint32_t t = static_cast<uint32_t>(Rand(kTimelines));
      fences_.Complete(t, fences_.completed(t) + 1 + Rand(2));
      if (Rand(2) == 0) manager_->ReclaimRetired();
    } else {
      Import();
    }
    if (::testing::Test::HasFatalFailure()) return;
    const absl::Status inv = manager_->CheckInvariants();
    ASSERT_TRUE(inv.ok()) << inv << "\n" << manager_->DebugString();
    if (const std::optional<KvCacheManager::QuotaUse> quota = manager_->QuotaOf(kNamespace)) {
      ASSERT_LE(quota->used, quota->bound);
    }
    CheckTables();
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_TRUE(mirror_.Follow(*manager_->events()));
    uint64_t resume = 0;
    ASSERT_TRUE(mirror_.Matches(manager_->SnapshotEvents(&resume)));
  }
  // The run exercised what it is for.
  EXPECT_GT(tally_.resumes, 20);
  EXPECT_GT(tally_.window_cuts, 5);
  EXPECT_GT(tally_.refusals, 5);
  if (manager_->QuotaOf(kNamespace)) {
    EXPECT_GT(tally_.quota_refusals, 20);
  }
  EXPECT_GT(tally_.truncate_refused, 5);
  EXPECT_GT(tally_.slid, 100);
  EXPECT_GT(tally_.lagging, 20);
  EXPECT_GT(tally_.imports, 20);
  EXPECT_GT(manager_->stats().windows.evicted, 10u);
  // Window blocks announced as group 1: beside full blocks only, so not with a window too short
  // to read a full block back (W 1: only the block being written).
  if (window_ > 1) {
    EXPECT_GT(mirror_.stored(1), 10u);
  }
  std::printf(
      "resumes %lld (window cuts %lld), refusals %lld (quota %lld), truncates refused %lld, "
      "slid %lld, "
      "steps %lld (%lld extended first), imports %lld, window blocks kept %llu evicted %llu "
      "announced %llu\n",
      static_cast<long long>(tally_.resumes), static_cast<long long>(tally_.window_cuts),
      static_cast<long long>(tally_.refusals), static_cast<long long>(tally_.quota_refusals),
      static_cast<long long>(tally_.truncate_refused), static_cast<long long>(tally_.slid),
      static_cast<long long>(tally_.steps), static_cast<long long>(tally_.lagging),
      static_cast<long long>(tally_.imports),
      static_cast<unsigned long long>(manager_->stats().windows.kept),
      static_cast<unsigned long long>(manager_->stats().windows.evicted),
      static_cast<unsigned long long>(mirror_.stored(1)));
}

INSTANTIATE_TEST_SUITE_P(Seeds, WindowGroupRandomTest,
                         ::testing::Values(Config{1, 5, 0}, Config{2, 8, 2}, Config{3, 13, 4},
                                           Config{4, 3, 6}, Config{5, 9, 0}, Config{6, 16, 3},
                                           Config{7, 1, 0}, Config{8, 2, 5}));

}  // namespace
}  // namespace kvpool

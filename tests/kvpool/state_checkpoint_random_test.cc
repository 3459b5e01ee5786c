// Seeded randomized test of state checkpoints (docs/hybrid-groups.md §4) against a reference model:
// a KvCacheManager with few state slots, some of them for checkpoints, driven the way the step
// planner drives it (Allocate with prompts from a few shared families, then PlanCheckpoints, a
// step that writes the checkpoints and the working state at its fence, MarkStatesInFlight,
// AdvanceState, Commit), mixed with decode steps, client commits before a step ran, step undos
// (Truncate back to the step's start), steps given back after they ran (their writes land, the
// tokens go back, the state is lost: LoseState), Fork, Grow, Truncate, Free (discard and commit),
// FreeSession, EvictCached, fences completed out of order across timelines and ReclaimRetired.
//
// The slots' bytes are simulated (tests/kvpool/simulated_state_slots.h): a state's content names
// the exact tokens it has consumed, and device work lands at its fence, checking what it reads.
// So a checkpoint that does not hold the state it claims (kept before its step ran, at the wrong
// block or offset, its slot reused under a pending fence, a resume copied from the wrong slot)
// shows up as data: a resumed sequence's state, once its copy lands, must be the state after the
// prompt's first matched_tokens tokens.
// After every operation: CheckInvariants(), the code the model predicts (a refused call changes
// nothing), the deepest checkpoint a prompt reaches, every slot's state, and the checkpoints
// within checkpoint_slots.
//
// KVPOOL_CKPT_RANDOM_OPS=N runs N operations per seed instead of the default (6,000; the ci-clang
// test preset sets 4,000: under the sanitizers the checks after every operation make it CI's
// longest test).

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <initializer_list>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/checkpoint_reference.h"
#include "tests/kvpool/event_mirror.h"
#include "tests/kvpool/kv_cache_manager_test_peer.h"
#include "tests/kvpool/simulated_state_slots.h"
#include "tests/kvpool/timeline_fences.h"

namespace kvpool {
namespace {

using Code = absl::StatusCode;

// Working states' slots: three beside the checkpoints' (six with three checkpoint slots).
constexpr int32_t kWorkingSlots = 3;
constexpr int32_t kMaxBlocksPerSeq = 8;
constexpr int32_t kNumBlocks = 256;  // the KV pool never refuses: only the state group does
constexpr int32_t kAlphabet = 4;     // few tokens: prompts share prefixes and diverge often
constexpr int32_t kFamilyTokens = 24;
constexpr uint64_t kMaxOutstanding = 2;  // unfinished fences per timeline
constexpr SessionId kSessions[] = {SessionId(1), SessionId(2)};
constexpr NamespaceId kNamespace(7);
constexpr size_t kMaxRemembered = 12;

constexpr auto kLru = KvCacheOptions::CheckpointEviction::kLeastRecentlyUsed;
constexpr auto kByTokensSaved = KvCacheOptions::CheckpointEviction::kByTokensSaved;
constexpr auto kByExpected = KvCacheOptions::CheckpointEviction::kByExpectedTokensSaved;

struct Config {
  uint64_t seed;
  int32_t block_size;
  int32_t interval;
  // Few: slot pressure is what the run exercises. 8 leaves two rolling checkpoints (a quarter).
  int32_t checkpoint_slots = 3;
  // The order cached checkpoints are evicted in (the default, or least recently used).
  KvCacheOptions::CheckpointEviction eviction = KvCacheOptions::CheckpointEviction::kByTokensSaved;
  // > 0: the checkpoints' priorities are rebased once their floor reaches this many tokens (real
  // runs: 2^62), so the manager's rebase is run. At least the longest sequence's tokens.
  uint64_t rebase_at = 0;
};

void PrintTo(const Config& c, std::ostream* os) {
  *os << "seed " << c.seed << ", block_size " << c.block_size << ", interval " << c.interval
      << ", checkpoint_slots " << c.checkpoint_slots << (c.eviction == kLru ? ", lru" : "")
      << (c.eviction == kByExpected ? ", expected" : "")
      << (c.rebase_at > 0 ? ", rebase at " + std::to_string(c.rebase_at) : "");
}

struct Planned {
  PlannedCheckpoint c;
  bool written = false;  // a step enqueued its write
};

// What the run must have exercised (checked against lower bounds at the end).
struct Tally {
  int64_t resumes = 0;         // Allocates that resumed from a checkpoint
  int64_t state_refusals = 0;  // refused for want of state slots
  int64_t early_commits = 0;   // planned checkpoints that a commit could not keep yet
  int64_t rolling = 0;         // rolling checkpoints planned, new or moved on
  int64_t rolled = 0;          // of which moved on to a later block boundary
  int64_t undos = 0;           // steps undone by Truncate
  int64_t give_backs = 0;      // steps given back after they ran (their state lost)
  int64_t steps = 0;
};

class StateCheckpointRandomTest : public ::testing::TestWithParam<Config> {
 protected:
  static int32_t StateSlots() { return kWorkingSlots + GetParam().checkpoint_slots; }
  struct Seq {
    SessionId session;
    int64_t tokens = 0;
    std::vector<int32_t> content;  // the token at every position
    int64_t known = 0;             // tokens the manager knows
    int64_t st = 0;                // tokens its working state holds (-1: unknown)
    bool lost = false;             // its state holds tokens it no longer has (LoseState)
    int32_t slot = -1;
    uint64_t value = 0;  // what its slot holds once every enqueued operation landed
    int64_t branch_at = 0;
    int32_t resumed_from = -1;
    std::vector<Planned> planned;  // what the manager says it still holds
    bool stepping = false;         // a step planned and not yet run or undone
    int64_t step_from = 0;
    int64_t step_to = 0;
  };

  void SetUp() override {
    bs_ = GetParam().block_size;
    max_tokens_ = int64_t{bs_} * kMaxBlocksPerSeq;
    rng_.seed(GetParam().seed);
    auto cache = KvCacheManager::Create({.block_size = bs_,
                                         .num_blocks = kNumBlocks,
                                         .max_blocks_per_seq = kMaxBlocksPerSeq,
                                         .trace_depth = 0,
                                         .clock = &clock_,
                                         .fences = &fences_,
                                         .eviction_shares = GetParam().seed % 2 == 0 ? 2 : 0,
                                         .state_slots = StateSlots(),
                                         .checkpoint_slots = GetParam().checkpoint_slots,
                                         .checkpoint_interval = GetParam().interval,
                                         .checkpoint_eviction = GetParam().eviction,
                                         .block_bytes = 64,
                                         .state_bytes = 256});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    if (GetParam().rebase_at > 0) {
      KvCacheManagerTestPeer::RebaseCheckpointsAt(*cache_, GetParam().rebase_at);
    }
    // Even seeds put the namespace in an eviction share of its own (fair eviction): checkpoints
    // are charged to it, and slot pressure picks its victims by share.
    if (GetParam().seed % 2 == 0) {
      ASSERT_TRUE(cache_->SetEvictionShare(kNamespace, 5).ok());
    }
    for (auto& family : families_) {
      for (int32_t i = 0; i < kFamilyTokens; ++i) family.push_back(Token());
    }
  }

  int64_t Rand(int64_t n) { return static_cast<int64_t>(rng_() % static_cast<uint64_t>(n)); }
  int32_t Token() { return static_cast<int32_t>(Rand(kAlphabet)); }
  int64_t BlocksFor(int64_t t) const { return (t + bs_ - 1) / bs_; }

  // Slots live sequences hold: working states, planned checkpoints, resumed-from checkpoints.
  std::set<int32_t> Held() const {
    std::set<int32_t> held;
    for (const auto& [id, m] : seqs_) {
      held.insert(m.slot);
      for (const Planned& p : m.planned) held.insert(p.c.slot.value());
      if (m.resumed_from >= 0) held.insert(m.resumed_from);
    }
    return held;
  }
  // The manager handed `slot` out anew: nobody may hold it and its fences must have passed.
  void HandOut(BlockId block) {
    ASSERT_FALSE(Held().contains(block.value())) << "slot " << block << " handed out while held";
    slots_.HandOut(block.value());
  }
  void MarkStates(const std::vector<BlockId>& slots, Fence fence) {
    ASSERT_TRUE(cache_->MarkStatesInFlight(slots, fence).ok());
    slots_.Marked(slots, fence);
  }

  // Slots a call may take for working states (free, or reclaimable, or a cached checkpoint whose
  // fences passed, not in `keep`), and of them the ones not holding a checkpoint.
  std::pair<int64_t, int64_t> Room(
      const std::set<int32_t>& keep,
      const std::map<int32_t, testing::CachedCheckpoint>& ckpts) const {
    const std::set<int32_t> held = Held();
    std::set<int32_t> cached;
    for (const auto& [block, c] : ckpts) cached.insert(c.slot);
    int64_t all = 0, free = 0;
    for (int32_t s = 0; s < StateSlots(); ++s) {
      if (held.contains(s) || !slots_.Passed(s) || keep.contains(s)) continue;
      ++all;
      if (!cached.contains(s)) ++free;
    }
    return {all, free};
  }

  void ExpectRefused(const absl::Status& status, const std::string& before, const DevicePlan& plan,
                     int64_t short_by) {
    ASSERT_TRUE(plan.empty());
    ASSERT_EQ(cache_->DebugString(), before) << "a refused call changed state: " << status;
    const std::optional<Shortfall> shortfall = GetShortfall(status);
    if (status.code() == Code::kResourceExhausted && shortfall &&
        shortfall->resource == Resource::kStateSlots) {
      ASSERT_EQ(shortfall->blocks, short_by) << status;
      ++tally_.state_refusals;
    }
  }
  std::string Snapshot() {
    cache_->ReclaimRetired();
    return cache_->DebugString();
  }

  SequenceId PickSequence() {
    if (seqs_.empty() || Rand(50) == 0) return SequenceId(1'000'000 + Rand(5));
    auto it = seqs_.begin();
    std::advance(it, Rand(static_cast<int64_t>(seqs_.size())));
    return it->first;
  }
  SessionId PickCaller(SequenceId id) {
    auto it = seqs_.find(id);
    if (it == seqs_.end() || Rand(50) == 0) return kSessions[Rand(2)];
    return it->second.session;
  }
  Code Ownership(SessionId caller, SequenceId id) const {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return Code::kNotFound;
    return it->second.session == caller ? Code::kOk : Code::kPermissionDenied;
  }

  std::vector<int32_t> PickPrompt() {
    std::vector<int32_t> p;
    const int64_t kind = Rand(10);
    if (kind < 6) {
      const auto& family = families_[static_cast<size_t>(Rand(3))];
      p.assign(family.begin(), family.begin() + 1 + Rand(kFamilyTokens));
    } else if (kind < 8 && !remembered_.empty()) {
      p = remembered_[static_cast<size_t>(Rand(static_cast<int64_t>(remembered_.size())))];
      p.resize(static_cast<size_t>(1 + Rand(static_cast<int64_t>(p.size()))));
    } else if (kind < 9) {
      p.push_back(Token());
    }
    for (int64_t extra = Rand(3) * Rand(4); extra > 0; --extra) p.push_back(Token());
    if (static_cast<int64_t>(p.size()) > max_tokens_) p.resize(static_cast<size_t>(max_tokens_));
    return p;
  }

  void StepAllocate() {
    const SessionId caller = kSessions[Rand(2)];
    const size_t n = static_cast<size_t>(1 + Rand(2));
    std::vector<std::vector<int32_t>> prompts(n);
    std::vector<AllocateRequest> batch;
    std::vector<std::pair<int64_t, int32_t>> deepest;
    std::vector<int64_t> attention;
    std::set<int32_t> keep;
    const auto cached = testing::CachedCheckpoints(*cache_);
    Code want = Code::kOk;
    for (size_t k = 0; k < n; ++k) {
      prompts[k] = PickPrompt();
      const auto size = static_cast<int64_t>(prompts[k].size());
      AllocateRequest r{.ns = kNamespace, .num_tokens = size + Rand(max_tokens_ - size + 1)};
      if (Rand(40) == 0) r.num_tokens = max_tokens_ + 1 + Rand(bs_);
      if (BlocksFor(r.num_tokens) > kMaxBlocksPerSeq) want = Code::kResourceExhausted;
      r.prompt = prompts[k];
      batch.push_back(r);
      attention.push_back(cache_->cache()->Match(kNamespace, prompts[k]).matched_tokens);
      deepest.push_back(testing::DeepestCheckpoint(*cache_, cached, kNamespace, prompts[k]));
      if (deepest.back().second >= 0) keep.insert(deepest.back().second);
    }
    const auto [room, free] = Room(keep, cached);
    if (want == Code::kOk && static_cast<int64_t>(n) > room) want = Code::kResourceExhausted;
    const std::string before = want == Code::kOk ? "" : Snapshot();
    const uint64_t missed_before = cache_->stats().missed_no_checkpoint;
    std::vector<AllocateResult> results;
    DevicePlan plan;
    const absl::Status status = cache_->AllocateBatch(caller, batch, &results, &plan);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) return ExpectRefused(status, before, plan, static_cast<int64_t>(n) - free);
    ASSERT_EQ(results.size(), n);
    ASSERT_EQ(plan.state_zeros.size() + plan.state_copies.size(), n);
    uint64_t missed = 0;
    for (size_t k = 0; k < n; ++k) {
      ASSERT_EQ(results[k].matched_tokens, deepest[k].first)
          << "prompt " << k << " did not resume from the deepest checkpoint it reaches";
      missed += static_cast<uint64_t>(attention[k] - deepest[k].first);
      Adopt(caller, results[k].sequence, prompts[k], batch[k].num_tokens, deepest[k], attention[k],
            plan);
      if (HasFatalFailure()) return;
    }
    ASSERT_EQ(cache_->stats().missed_no_checkpoint - missed_before, missed);
    std::set<int32_t> used;
    for (const AllocateResult& r : results) used.insert(seqs_.at(r.sequence).resumed_from);
    bool in_order = false;
    const auto after = testing::CachedCheckpoints(*cache_, &in_order);
    ASSERT_TRUE(in_order) << "the checkpoints are not listed by priority, then stamp";
    ASSERT_TRUE(testing::UsedLast(after, used)) << "a checkpoint resumed from is not the last used";
    // Used now: its priority is today's floor plus what it saves (the tokens between it and the
    // next checkpoint up the prompt's path), or the floor alone in least-recently-used order.
    // Weighed by kind, what it saves counts between 1/256 and 64 times (kind_rates_ move with
    // every resume of the batch; their arithmetic is state_checkpoint_test's).
    const uint64_t floor = testing::CheckpointFloor(*cache_);
    for (size_t k = 0; k < n; ++k) {
      if (deepest[k].second < 0) continue;
      const uint64_t want = GetParam().eviction == kLru
                                ? 0
                                : static_cast<uint64_t>(testing::TokensOverTheNextCheckpointUp(
                                      *cache_, after, kNamespace, prompts[k]));
      for (const auto& [block, c] : after) {
        if (c.slot == deepest[k].second) {
          if (GetParam().eviction == kByExpected) {
            ASSERT_GE(c.priority, floor) << "slot " << c.slot;
            ASSERT_LE(c.priority, floor + 64 * want) << "slot " << c.slot;
          } else {
            ASSERT_EQ(c.priority, floor + want) << "slot " << c.slot;
          }
        }
      }
    }
    EnqueuePlan(plan);
    for (const AllocateResult& r : results) {
      if (Rand(4) != 0) StepCompute(r.sequence, /*run=*/Rand(5) != 0);
      if (HasFatalFailure()) return;
    }
  }

  // Records a new sequence, checking the plan's state work for it.
  void Adopt(SessionId caller, SequenceId id, const std::vector<int32_t>& prompt, int64_t tokens,
             std::pair<int64_t, int32_t> deepest, int64_t attention, const DevicePlan& plan) {
    const Sequence* s = cache_->Find(id);
    ASSERT_NE(s, nullptr);
    const int32_t slot = s->state_slot.value();
    const auto [matched, from] = deepest;
    const auto zeroed = std::count(plan.state_zeros.begin(), plan.state_zeros.end(), s->state_slot);
    const auto copied = std::count(plan.state_copies.begin(), plan.state_copies.end(),
                                   BlockCopy{BlockId(from), s->state_slot});
    ASSERT_EQ(zeroed + copied, 1) << "sequence " << id << "'s slot " << slot << " is not "
                                  << (from >= 0 ? "copied from the checkpoint" : "zeroed");
    ASSERT_EQ(copied == 1, from >= 0);
    // Its path's full blocks are whole in the match: it writes from `matched` on, never into them.
    ASSERT_LE(static_cast<int64_t>(s->path.full.size()) * bs_, matched) << "sequence " << id;
    HandOut(s->state_slot);
    Seq& m = seqs_[id];
    m = Seq{.session = caller, .tokens = tokens, .content = prompt};
    m.known = static_cast<int64_t>(prompt.size());
    while (static_cast<int64_t>(m.content.size()) < tokens) m.content.push_back(Token());
    m.st = matched;
    m.slot = slot;
    m.value = slots_.State(prompt, matched);
    m.resumed_from = from;
    const int64_t branch = attention / bs_ * bs_;
    m.branch_at = branch > matched ? branch : 0;
    if (from >= 0) ++tally_.resumes;
  }

  // Enqueues a plan's state work (zeros, copies out of checkpoints or parents), each up to its
  // own fence.
  void EnqueuePlan(const DevicePlan& plan) {
    for (BlockId z : plan.state_zeros) {
      const Fence fence = slots_.NewFence({z.value()});
      MarkStates({z}, fence);
      slots_.Enqueue({.dst = z.value(), .fence = fence, .what = "zero"});
    }
    for (const BlockCopy& c : plan.state_copies) {
      uint64_t want = 0;  // the new sequence's state, as its parent's or the prompt's
      bool resume = false;
      for (const auto& [id, m] : seqs_) {
        if (m.slot == c.dst.value())
          std::tie(want, resume) = std::pair{m.value, m.resumed_from >= 0};
      }
      const Fence fence = slots_.NewFence({c.src.value(), c.dst.value()});
      MarkStates({c.src, c.dst}, fence);
      slots_.Enqueue({.dst = c.dst.value(),
                      .src = c.src.value(),
                      .copy = true,
                      .src_want = want,
                      .fence = fence,
                      .what = resume ? "resume copy" : "fork copy"});
    }
    slots_.Land();
  }

  // Plans a step of `id` from its state's tokens (the rest of its prompt, or one to a few
  // tokens), and runs it unless `run` is false (it is then run or undone later).
  void StepCompute(SequenceId id, bool run) {
    Seq& m = seqs_.at(id);
    if (m.stepping || m.st < 0 || m.st >= m.tokens) return;
    const int64_t from = m.st;
    // With room for rolling checkpoints, half the steps past the prompt are decodes (one token).
    const bool decode = GetParam().checkpoint_slots >= 4 && from >= m.known && Rand(2) == 0;
    const int64_t to = from < m.known ? m.known
                       : decode       ? from + 1
                                : from + 1 + Rand(std::min<int64_t>(m.tokens - from, bs_ * 2));
    const bool prefill = to - from > 1;
    std::vector<int64_t> want =
        testing::WantedCheckpoints(from, to, prefill, m.branch_at, GetParam().interval, bs_);
    // A decode ending on a block boundary nothing else wants: the sequence's rolling checkpoint
    // moves there (its slot), or is planned anew, or skipped.
    const bool rolling =
        !prefill && to % bs_ == 0 && !std::binary_search(want.begin(), want.end(), to);
    auto held = std::find_if(m.planned.begin(), m.planned.end(),
                             [](const Planned& p) { return p.c.rolling; });
    std::erase_if(want, [&](int64_t p) {
      return std::any_of(m.planned.begin(), m.planned.end(),
                         [&](const Planned& c) { return c.c.position == p; });
    });
    if (rolling) want.push_back(to);
    const uint64_t skipped = cache_->stats().checkpoints.skipped;
    const uint64_t rolled = cache_->stats().checkpoints.rolled;
    std::vector<PlannedCheckpoint> out;
    ASSERT_TRUE(cache_->PlanCheckpoints(m.session, id, from, to, prefill, &out).ok());
    ASSERT_EQ(out.size() + (cache_->stats().checkpoints.skipped - skipped), want.size());
    ASSERT_EQ(cache_->stats().checkpoints.rolled - rolled,
              rolling && held != m.planned.end() ? 1u : 0u);
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_TRUE(std::find(want.begin(), want.end(), out[i].position) != want.end())
          << "checkpoint planned at " << out[i].position;
      ASSERT_TRUE(i == 0 || out[i - 1].position < out[i].position);
      ASSERT_EQ(out[i].rolling, rolling && out[i].position == to);
      tally_.rolling += out[i].rolling ? 1 : 0;
      if (out[i].rolling && held != m.planned.end()) {
        // The same slot, rewritten by this step at its new position.
        ASSERT_EQ(out[i].slot, held->c.slot);
        *held = {out[i], false};
        ++tally_.rolled;
        continue;
      }
      HandOut(out[i].slot);
      m.planned.push_back({out[i], false});
    }
    std::sort(m.planned.begin(), m.planned.end(),
              [](const Planned& a, const Planned& b) { return a.c.position < b.c.position; });
    m.stepping = true;
    m.step_from = from;
    m.step_to = to;
    if (run) StepRun(id);
  }

  // The planned step runs: its writes (each checkpoint, then the working state, both read from
  // the working state) are enqueued up to a new fence; the state advances and the new tokens are
  // committed (whole blocks or all of them; now and then not at all).
  void StepRun(SequenceId id) {
    WriteStep(id);
    if (HasFatalFailure()) return;
    Seq& m = seqs_.at(id);
    ASSERT_TRUE(cache_->AdvanceState(m.session, id, m.step_to).ok());
    m.st = m.step_to;
    m.value = slots_.State(m.content, m.st);
    m.stepping = false;
    ++tally_.steps;
    if (Rand(8) == 0) return;  // committed later, or never
    const int64_t known = std::max(m.known, m.step_to);
    Commit(id, Rand(2) == 0 ? m.step_to / bs_ * bs_ : m.step_to, known);
  }

  // The planned step's device work: its writes are enqueued up to a new fence and its slots and
  // blocks marked in flight.
  void WriteStep(SequenceId id) {
    Seq& m = seqs_.at(id);
    const Fence fence = slots_.NewFence({m.slot});
    std::vector<BlockId> slots{BlockId(m.slot)};
    for (Planned& p : m.planned) {
      if (p.written || p.c.position > m.step_to) continue;
      p.written = true;
      slots.push_back(p.c.slot);
      slots_.Enqueue({.dst = p.c.slot.value(),
                      .src = m.slot,
                      .value = slots_.State(m.content, p.c.position),
                      .src_want = m.value,
                      .fence = fence,
                      .what = "step checkpoint write"});
    }
    slots_.Enqueue({.dst = m.slot,
                    .src = m.slot,
                    .value = slots_.State(m.content, m.step_to),
                    .src_want = m.value,
                    .fence = fence,
                    .what = "step state write"});
    MarkStates(slots, fence);
    ASSERT_TRUE(testing::Writable(*cache_, *cache_->Find(id), m.content, m.step_from / bs_,
                                  (m.step_to - 1) / bs_))
        << "a step of sequence " << id << " writes into a block the tree has with other tokens";
    ASSERT_TRUE(cache_->MarkInFlight(cache_->Find(id)->table, fence).ok());
  }

  // Commit of `upto` tokens, telling the manager of those up to `known`. A planned checkpoint it
  // puts into the tree must have been written by a step that ran.
  void Commit(SequenceId id, int64_t upto, int64_t known) {
    Seq& m = seqs_.at(id);
    const std::vector<int32_t> fresh(m.content.begin() + m.known, m.content.begin() + known);
    ASSERT_TRUE(cache_->Commit(m.session, id, upto, fresh).ok());
    m.known = known;
    Remember(m.content, known);
    const std::vector<PlannedCheckpoint>& left = cache_->Find(id)->checkpoints;
    const auto cached = testing::CachedCheckpoints(*cache_);
    for (const Planned& p : m.planned) {
      const bool kept = std::find(left.begin(), left.end(), p.c) == left.end();
      ASSERT_TRUE(!kept || (p.written && p.c.position <= m.st))
          << "checkpoint " << p.c.slot << "@" << p.c.position << " kept with the state at " << m.st
          << (p.written ? "" : ", never written");
      ASSERT_TRUE(!kept || testing::KeptWhereItBelongs(*cache_, cached, p.c.slot.value(), m.content,
                                                       p.c.position))
          << "checkpoint " << p.c.slot << "@" << p.c.position << " kept on another block";
      if (!kept && p.c.position > m.st) ++tally_.early_commits;
    }
  }

  // A client commits tokens the sequence has not computed yet (before its step ran).
  void StepClientCommit() {
    const SequenceId id = PickSequence();
    if (!seqs_.contains(id)) return;
    const Seq& m = seqs_.at(id);
    const int64_t known = m.known + Rand(m.tokens - m.known + 1);
    Commit(id, Rand(known + 1), known);
  }

  // The step failed: the sequence goes back to its start (refused below its known tokens).
  void StepUndo(SequenceId id) {
    Seq& m = seqs_.at(id);
    const Code want = m.step_from < m.known ? Code::kFailedPrecondition : Code::kOk;
    const std::string before = want == Code::kOk ? "" : Snapshot();
    const absl::Status status = cache_->Truncate(m.session, id, m.step_from);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) {
      ExpectRefused(status, before, DevicePlan{}, 0);
      return StepRun(id);  // it runs after all
    }
    ++tally_.undos;
    Shorten(&m, m.step_from);
  }
  // The step ran but its caller gave up (model::UndoItem with `ran`): its writes land, the tokens
  // go back to its start (refused below the known tokens: they stay), and its state, which no
  // copy can move back, is lost: no checkpoint may be taken from it, nor any step started.
  void StepGiveBack(SequenceId id) {
    WriteStep(id);
    if (HasFatalFailure()) return;
    Seq& m = seqs_.at(id);
    const uint64_t value = slots_.State(m.content, m.step_to);
    const Code want = m.step_from < m.known ? Code::kFailedPrecondition : Code::kOk;
    const std::string before = want == Code::kOk ? "" : Snapshot();
    const absl::Status status = cache_->Truncate(m.session, id, m.step_from);
    ASSERT_EQ(status.code(), want) << status;
    if (status.ok()) {
      Shorten(&m, m.step_from);
    } else {
      ExpectRefused(status, before, DevicePlan{}, 0);
      m.stepping = false;
    }
    ASSERT_TRUE(cache_->LoseState(m.session, id).ok());
    m.st = -1;
    m.lost = true;
    m.value = value;
    ++tally_.give_backs;
  }
  void Shorten(Seq* m, int64_t tokens) {
    m->tokens = tokens;
    m->content.resize(static_cast<size_t>(tokens));
    if (m->st > tokens) m->st = -1;
    std::erase_if(m->planned, [&](const Planned& p) { return p.c.position > tokens; });
    m->stepping = false;
  }

  void StepAdvance() {
    const SequenceId id = PickSequence();
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return;
    if (!it->second.stepping) return StepCompute(id, Rand(3) != 0);
    if (Rand(3) == 0) return StepUndo(id);
    if (Rand(5) == 0) return StepGiveBack(id);
    StepRun(id);
  }

  void StepGrow() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    auto it = seqs_.find(id);
    const int64_t current = it == seqs_.end() ? 0 : it->second.tokens;
    int64_t tokens = current + Rand(2 * bs_);
    if (Rand(20) == 0) tokens = max_tokens_ + 1;
    Code want = Ownership(caller, id);
    if (want == Code::kOk && tokens > current && BlocksFor(tokens) > kMaxBlocksPerSeq) {
      want = Code::kResourceExhausted;
    }
    const std::string before = want == Code::kOk ? "" : Snapshot();
    DevicePlan plan;
    const absl::Status status = cache_->Grow(caller, id, tokens, &plan);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) return ExpectRefused(status, before, plan, 0);
    for (; it->second.tokens < tokens; ++it->second.tokens) it->second.content.push_back(Token());
  }

  // Rewinds below the known tokens (refused), to or above them, or past the end.
  void StepTruncate() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    auto it = seqs_.find(id);
    if (it != seqs_.end() && it->second.stepping) return;
    const int64_t current = it == seqs_.end() ? 0 : it->second.tokens;
    const int64_t known = it == seqs_.end() ? 0 : it->second.known;
    int64_t tokens = known + Rand(current - known + 1);
    if (Rand(4) == 0) tokens = known > 0 ? Rand(known) : current + 1;
    Code want = Ownership(caller, id);
    if (want == Code::kOk && tokens > current) want = Code::kInvalidArgument;
    if (want == Code::kOk && tokens < known) want = Code::kFailedPrecondition;
    const std::string before = want == Code::kOk ? "" : Snapshot();
    const absl::Status status = cache_->Truncate(caller, id, tokens);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) return ExpectRefused(status, before, DevicePlan{}, 0);
    Shorten(&it->second, tokens);
  }

  void StepFork() {
    const SequenceId parent = PickSequence();
    const SessionId caller = PickCaller(parent);
    Code want = Ownership(caller, parent);
    const auto [room, free] = Room({}, testing::CachedCheckpoints(*cache_));
    if (want == Code::kOk && room < 1) want = Code::kResourceExhausted;
    const std::string before = want == Code::kOk ? "" : Snapshot();
    DevicePlan plan;
    const absl::StatusOr<SequenceId> child = cache_->Fork(caller, parent, &plan);
    ASSERT_EQ(child.status().code(), want) << child.status();
    if (!child.ok()) return ExpectRefused(child.status(), before, plan, 1 - free);
    const BlockId slot = cache_->Find(*child)->state_slot;
    ASSERT_EQ(plan.state_copies.size(), 1u);
    ASSERT_EQ(plan.state_copies[0], (BlockCopy{BlockId(seqs_.at(parent).slot), slot}));
    HandOut(slot);
    Seq m = seqs_.at(parent);
    m.slot = slot.value();
    m.planned.clear();
    m.stepping = false;
    m.branch_at = 0;
    m.resumed_from = -1;
    seqs_[*child] = std::move(m);
    EnqueuePlan(plan);
  }

  void Remember(const std::vector<int32_t>& content, int64_t tokens) {
    if (tokens == 0) return;
    const auto at = static_cast<size_t>(remembered_.size() < kMaxRemembered ? remembered_.size()
                                                                            : Rand(kMaxRemembered));
    if (at == remembered_.size()) remembered_.emplace_back();
    remembered_[at].assign(content.begin(), content.begin() + tokens);
  }

  void StepFree() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    const Code want = Ownership(caller, id);
    const OnFree on_free = Rand(3) != 0 ? OnFree::kCommit : OnFree::kDiscard;
    const std::string before = want == Code::kOk ? "" : Snapshot();
    const absl::Status status = cache_->Free(caller, id, on_free);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) return ExpectRefused(status, before, DevicePlan{}, 0);
    const Seq& m = seqs_.at(id);
    if (on_free == OnFree::kCommit) {
      Remember(m.content, m.known);
      // Its working state, the checkpoint at its end if kept, and those it planned.
      const auto cached = testing::CachedCheckpoints(*cache_);
      ASSERT_TRUE(m.st <= 0 ||
                  testing::KeptWhereItBelongs(*cache_, cached, m.slot, m.content, m.st));
      for (const Planned& p : m.planned) {
        ASSERT_TRUE(
            testing::KeptWhereItBelongs(*cache_, cached, p.c.slot.value(), m.content, p.c.position))
            << "checkpoint " << p.c.slot << "@" << p.c.position << " kept on another block";
      }
    }
    seqs_.erase(id);
  }

  void StepFreeSession() {
    const SessionId session = kSessions[Rand(2)];
    const auto gone = static_cast<int64_t>(
        std::erase_if(seqs_, [&](const auto& e) { return e.second.session == session; }));
    ASSERT_EQ(cache_->FreeSession(session), gone);
  }

  void StepReclaim() {
    cache_->ReclaimRetired();
    std::set<int32_t> cached;
    for (const auto& [block, c] : testing::CachedCheckpoints(*cache_)) cached.insert(c.slot);
    const std::set<int32_t> held = Held();
    int32_t retiring = 0;
    for (int32_t s = 0; s < StateSlots(); ++s) {
      retiring += !held.contains(s) && !cached.contains(s) && !slots_.Passed(s) ? 1 : 0;
    }
    ASSERT_EQ(cache_->stats().states.retiring, retiring);
  }

  void Step(uint64_t dice) {
    if (dice < 160) return StepAllocate();
    if (dice < 380) return StepAdvance();
    if (dice < 420) return StepClientCommit();
    if (dice < 480) return StepGrow();
    if (dice < 530) return StepTruncate();
    if (dice < 580) return StepFork();
    if (dice < 740) return StepFree();
    if (dice < 745) return StepFreeSession();
    if (dice < 765) return static_cast<void>(cache_->EvictCached(1 + Rand(8)));
    if (dice < 975) return slots_.Complete(static_cast<uint32_t>(Rand(kMaxTimelines)));
    return StepReclaim();
  }

  void Verify();

  int32_t bs_ = 0;
  int64_t max_tokens_ = 0;
  ManualClock clock_;
  testing::TimelineFences fences_;
  std::unique_ptr<KvCacheManager> cache_;
  std::map<SequenceId, Seq> seqs_;
  testing::SimulatedStateSlots slots_{StateSlots(), &fences_, &rng_, kMaxOutstanding};
  std::array<std::vector<int32_t>, 3> families_;
  std::vector<std::vector<int32_t>> remembered_;
  Tally tally_;
  EventMirror mirror_{/*grouped=*/true};
  std::mt19937_64 rng_;
};

void StateCheckpointRandomTest::Verify() {
  const KvCacheStats stats = cache_->stats();
  ASSERT_EQ(stats.sequences, static_cast<int64_t>(seqs_.size()));
  ASSERT_LE(stats.checkpoints.cached + stats.checkpoints.pending, GetParam().checkpoint_slots);
  const BlockPool& states = *cache_->states();
  for (auto& [id, m] : seqs_) {
    const Sequence* s = cache_->Find(id);
    ASSERT_NE(s, nullptr) << id;
    ASSERT_EQ(s->num_tokens, m.tokens) << id;
    ASSERT_EQ(s->tokens, std::vector<int32_t>(m.content.begin(), m.content.begin() + m.known));
    ASSERT_EQ(s->state_slot, BlockId(m.slot)) << "sequence " << id << " changed slots";
    ASSERT_EQ(s->state_tokens, m.st) << id;
    ASSERT_EQ(s->state_lost, m.lost) << id;
    ASSERT_EQ(cache_->CheckStateUsable(*s).code(), m.lost ? Code::kFailedPrecondition : Code::kOk)
        << id;
    ASSERT_EQ(s->branch_at, m.branch_at) << id;
    ASSERT_EQ(s->resumed_from, BlockId(m.resumed_from)) << id;
    // The manager's planned checkpoints: those the model planned, less the ones kept or dropped.
    for (const PlannedCheckpoint& c : s->checkpoints) {
      ASSERT_TRUE(std::any_of(m.planned.begin(), m.planned.end(),
                              [&](const Planned& p) { return p.c == c; }))
          << "sequence " << id << " holds a checkpoint never planned: " << c.slot;
    }
    std::erase_if(m.planned, [&](const Planned& p) {
      return std::find(s->checkpoints.begin(), s->checkpoints.end(), p.c) == s->checkpoints.end();
    });
    if (m.st >= 0 && !slots_.Pending(m.slot)) {
      ASSERT_EQ(slots_.bytes(m.slot), m.value)
          << "sequence " << id << "'s state in slot " << m.slot;
    }
  }
  const std::set<int32_t> held = Held();
  for (int32_t s = 0; s < StateSlots(); ++s) {
    const BlockState state = states.state(BlockId(s));
    if (held.contains(s)) {
      ASSERT_EQ(state, BlockState::kActive) << "slot " << s;
    } else if (!slots_.Passed(s)) {
      ASSERT_TRUE(state == BlockState::kRetiring || state == BlockState::kCached)
          << "slot " << s << " is " << BlockStateName(state) << " before its fence passed";
    } else {
      ASSERT_NE(state, BlockState::kActive) << "slot " << s << " held by no sequence";
    }
  }
}

TEST_P(StateCheckpointRandomTest, OperationsAgreeWithTheModel) {
  int64_t ops = 6'000;
  if (const char* env = std::getenv("KVPOOL_CKPT_RANDOM_OPS")) ops = std::atoll(env);
  for (int64_t op = 0; op < ops; ++op) {
    clock_.Advance(1 + Rand(1000));
    Step(rng_() % 1000);
    if (HasFatalFailure()) FAIL() << "at operation " << op;
    const absl::Status invariants = cache_->CheckInvariants();
    ASSERT_TRUE(invariants.ok()) << "at operation " << op << ": " << invariants;
    Verify();
    if (HasFatalFailure()) FAIL() << "at operation " << op;
    if (op % 64 == 0) {
      ASSERT_TRUE(testing::DebugStringListsTheCheckpoints(*cache_)) << "at operation " << op;
    }
    ASSERT_TRUE(mirror_.Follow(*cache_->events())) << "at operation " << op;
    uint64_t resume = 0;
    ASSERT_TRUE(mirror_.Matches(cache_->SnapshotEvents(&resume))) << "at operation " << op;
  }
  const KvCacheStats s = cache_->stats();
  std::printf("ops=%" PRId64 " steps=%" PRId64 " resumes=%" PRId64 " checked=%" PRId64
              " state_refusals=%" PRId64 " early_commits=%" PRId64 " undos=%" PRId64
              " give_backs=%" PRId64 " reused=%" PRId64 " planned=%" PRIu64 " kept=%" PRIu64
              " skipped=%" PRIu64 " evicted=%" PRIu64 " rolled=%" PRId64 "\n",
              ops, tally_.steps, tally_.resumes, slots_.landed("resume copy"),
              tally_.state_refusals, tally_.early_commits, tally_.undos, tally_.give_backs,
              slots_.reused(), s.checkpoints.planned, s.checkpoints.kept, s.checkpoints.skipped,
              s.checkpoints.evicted, tally_.rolled);
  // The run must have exercised what it claims to.
  EXPECT_GT(slots_.landed("resume copy"), ops / 200);
  EXPECT_GT(tally_.state_refusals, ops / 200);
  EXPECT_GT(tally_.early_commits, 0);
  EXPECT_GT(tally_.undos, ops / 500);
  EXPECT_GT(tally_.give_backs, ops / 1000);
  // Moving one on takes a decode across two block boundaries before anything ends the sequence:
  // rare here (0 to 2 a run), and shown by ADecodesRollingCheckpointMovesOnInItsOwnSlot.
  if (GetParam().checkpoint_slots >= 4) {
    EXPECT_GT(tally_.rolling, 0);
  }
  EXPECT_GT(slots_.reused(), ops / 100);
  EXPECT_GT(s.checkpoints.evicted, static_cast<uint64_t>(ops / 100));
  EXPECT_GT(mirror_.stored(1), static_cast<uint64_t>(ops / 100));  // checkpoints, as group 1
  // Every rebase changed every cached checkpoint's priority: CheckInvariants compared each slot's
  // key with the order's, and the listing's priorities with the floor, after every operation.
  if (GetParam().rebase_at > 0) {
    EXPECT_GT(KvCacheManagerTestPeer::CheckpointRebases(*cache_),
              static_cast<uint64_t>(ops / 200));  // 60 and 63 in 6,000 operations
  }
}

INSTANTIATE_TEST_SUITE_P(
    Seeds, StateCheckpointRandomTest,
    ::testing::Values(Config{20261204, 4, 1}, Config{7, 4, 2}, Config{99, 8, 1, 3, kByExpected},
                      Config{1234, 8, 2}, Config{31, 4, 0, 8, kByExpected}, Config{42, 4, 3, 8},
                      Config{7, 4, 2, 3, kLru}, Config{42, 4, 3, 8, kLru},
                      Config{1234, 8, 2, 3, kByTokensSaved, 100},
                      Config{42, 4, 3, 8, kByTokensSaved, 64}),
    [](const ::testing::TestParamInfo<Config>& info) {
      return "seed" + std::to_string(info.param.seed) + "_block" +
             std::to_string(info.param.block_size) + "_every" +
             std::to_string(info.param.interval) + "_slots" +
             std::to_string(info.param.checkpoint_slots) +
             (info.param.eviction == kLru ? "_lru" : "") +
             (info.param.eviction == kByExpected ? "_expected" : "") +
             (info.param.rebase_at > 0 ? "_rebase" + std::to_string(info.param.rebase_at) : "");
    });

}  // namespace
}  // namespace kvpool

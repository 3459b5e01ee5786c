// Seeded randomized test of the KvCacheManager's state group (docs/hybrid-groups.md §3): a random
// mix of AllocateBatch (with and without prompts, some committed earlier), Fork, Grow, Commit,
// Truncate (below and above the known tokens), Free (discard and commit), FreeSession, model
// steps that mark states and blocks in flight on several timelines, fences completed out of order
// across timelines, and ReclaimRetired, against a reference model of the sequences and slots.
//
// The slots' bytes are simulated: a plan's state_zeros and state_copies are carried out when the
// call returns, as the daemon would, and a step's write lands in its slot when its fence
// completes (the kernel ran until then). The model says what every live sequence's state must be
// (zero after Allocate, its parent's after Fork, its last landed step's after that), so a slot two
// sequences share, a slot handed out while a step still writes it, a missed zero or a copy in the
// wrong direction shows up as data. After every step: CheckInvariants(), the status code the model
// predicts (a refused call changes nothing), the slots' states and stats().states.
//
// KVPOOL_STATE_RANDOM_OPS=N runs N operations instead of the default (20,000; the ci-clang test
// preset sets 12,000).

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"
#include "tests/kvpool/timeline_fences.h"

namespace kvpool {
namespace {

constexpr int32_t kBlockSize = 8;
constexpr int32_t kMaxBlocksPerSeq = 6;
constexpr int64_t kMaxTokens = int64_t{kBlockSize} * kMaxBlocksPerSeq;
constexpr int32_t kStateSlots = 6;
// Blocks enough that the KV pool never runs short: only the state group refuses for want of room,
// and the model need not follow the prefix cache's blocks. Beyond what the live sequences' tables
// hold (6 * 6) and a batch takes (3 * 6), a block can be held back only by a pending fence (at
// most 2 per timeline, 4 timelines, each step over at most 3 tables): 36 + 18 + 144 < 224.
constexpr int32_t kNumBlocks = 224;
constexpr uint64_t kMaxOutstanding = 2;  // unfinished fences per timeline
constexpr SessionId kSessions[] = {SessionId(1), SessionId(2)};
constexpr NamespaceId kNamespaces[] = {NamespaceId(11), NamespaceId(22)};
constexpr size_t kMaxPrompts = 16;  // committed prompts remembered for reuse

using Code = absl::StatusCode;

int64_t BlocksFor(int64_t tokens) { return (tokens + kBlockSize - 1) / kBlockSize; }

using TestFences = testing::TimelineFences;

// A step's write of a sequence's state: lands when its fence has passed and every earlier write
// to the same slot has landed (a step reads the state the previous one wrote).
struct PendingWrite {
  int32_t slot;
  uint64_t value;
  Fence fence;
  SequenceId sequence;
};

// What the run must have exercised (checked against lower bounds at the end).
struct Tally {
  int64_t state_refusals = 0;     // Allocate/Fork refused with Resource::kStateSlots
  int64_t forks = 0;              // successful forks
  int64_t reused = 0;             // slots handed out again after waiting RETIRING for a fence
  int64_t truncate_refusals = 0;  // rewinds below the known tokens refused
  int64_t landed = 0;             // step writes that landed in a live sequence's slot
  int64_t prompt_reuses = 0;      // allocations whose prompt the attention tree partly held
};

class StateGroupRandomTest : public ::testing::Test {
 protected:
  struct Seq {
    SessionId session;
    NamespaceId ns;
    int64_t tokens = 0;
    std::vector<int32_t> content;  // the token at every position
    int64_t known = 0;             // tokens the manager knows (prompt and commits)
    int32_t slot = -1;             // its state slot (as the manager handed it out)
    uint64_t state = 0;            // what its slot must hold
  };
  struct Prompt {
    NamespaceId ns;
    std::vector<int32_t> tokens;
  };

  void SetUp() override {
    auto cache = KvCacheManager::Create({.block_size = kBlockSize,
                                         .num_blocks = kNumBlocks,
                                         .max_blocks_per_seq = kMaxBlocksPerSeq,
                                         .trace_depth = 0,  // keeps DebugString short
                                         .clock = &clock_,
                                         .fences = &fences_,
                                         .state_slots = kStateSlots});
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
    // Garbage in every slot: a state never zeroed shows up at its first use.
    for (int32_t s = 0; s < kStateSlots; ++s) arena_[s] = 0xdead0000u + static_cast<uint64_t>(s);
  }

  // Every fence the slot was marked with since it was handed out has passed.
  bool Passed(int32_t slot) const {
    for (uint32_t t = 0; t < kMaxTimelines; ++t) {
      if (marks_[slot][t] > fences_.completed(t)) return false;
    }
    return true;
  }
  bool Live(int32_t slot) const {
    return std::any_of(seqs_.begin(), seqs_.end(),
                       [&](const auto& e) { return e.second.slot == slot; });
  }
  // Released slots still waiting for a fence: RETIRING, whatever the manager has reclaimed.
  int32_t MustRetire() const {
    int32_t n = 0;
    for (int32_t s = 0; s < kStateSlots; ++s) n += !Live(s) && !Passed(s) ? 1 : 0;
    return n;
  }
  // Slots a call may take: free ones and those whose fences have passed.
  int64_t Available() const {
    return kStateSlots - static_cast<int64_t>(seqs_.size()) - MustRetire();
  }

  // The manager handed `slot` to a new sequence: it must be nobody's and past its fences.
  void HandOut(BlockId block) {
    const int32_t slot = block.value();
    ASSERT_TRUE(slot >= 0 && slot < kStateSlots) << "slot " << slot;
    ASSERT_FALSE(Live(slot)) << "slot " << slot << " handed out while a sequence holds it";
    ASSERT_TRUE(Passed(slot)) << "slot " << slot << " handed out before its fence passed";
    if (retired_[slot]) ++tally_.reused;
    retired_[slot] = false;
    marks_[slot].fill(0);
  }
  void Forget(SequenceId id) {
    const int32_t slot = seqs_.at(id).slot;
    seqs_.erase(id);
    retired_[slot] = !Passed(slot);
  }

  // Carries out a plan's state work the way the daemon would, once the call has returned.
  void Execute(const DevicePlan& plan) {
    for (BlockId slot : plan.state_zeros) arena_[slot.value()] = 0;
    for (const BlockCopy& copy : plan.state_copies)
      arena_[copy.dst.value()] = arena_[copy.src.value()];
  }

  // Sometimes marks the slots a plan's state work touches in flight, as the daemon does when it
  // enqueues it (the work itself was carried out by Execute): a parent freed right after a fork
  // keeps its slot RETIRING until the copy's fence passed.
  void MarkPlan(const DevicePlan& plan) {
    const uint32_t timeline = static_cast<uint32_t>(Rand(kMaxTimelines));
    if (Rand(2) == 0 || fences_.Outstanding(timeline) >= kMaxOutstanding) return;
    std::vector<BlockId> slots(plan.state_zeros.begin(), plan.state_zeros.end());
    for (const BlockCopy& copy : plan.state_copies) {
      slots.push_back(copy.src);
      slots.push_back(copy.dst);
    }
    const Fence fence = fences_.Issue(timeline);
    ASSERT_TRUE(cache_->MarkStatesInFlight(slots, fence).ok());
    for (BlockId slot : slots) {
      uint64_t& mark = marks_[slot.value()][timeline];
      mark = std::max(mark, fence.value);
    }
  }

  // Lands every pending write whose fence has passed, in issue order per slot.
  void Land() {
    std::array<bool, kStateSlots> blocked{};
    std::deque<PendingWrite> kept;
    for (const PendingWrite& w : pending_) {
      if (blocked[w.slot] || !fences_.HasPassed(w.fence)) {
        blocked[w.slot] = true;
        kept.push_back(w);
        continue;
      }
      arena_[w.slot] = w.value;
      auto it = seqs_.find(w.sequence);
      if (it != seqs_.end()) {
        it->second.state = w.value;
        ++tally_.landed;
      }
    }
    pending_ = std::move(kept);
  }

  // Before a call the model expects refused: the housekeeping any call may do first (reclaiming
  // slots and blocks whose fences passed) done now, so the call must change nothing at all.
  std::string Snapshot() {
    cache_->ReclaimRetired();
    return cache_->DebugString();
  }

  void Verify() {
    ASSERT_EQ(cache_->stats().sequences, static_cast<int64_t>(seqs_.size()));
    ASSERT_EQ(cache_->stats().hit_tokens, 0u) << "a prompt resumed without a state checkpoint";
    const BlockPoolStats st = cache_->stats().states;
    ASSERT_EQ(st.num_blocks, kStateSlots);
    ASSERT_EQ(st.free + st.active + st.retiring, kStateSlots);
    ASSERT_EQ(st.active, static_cast<int32_t>(seqs_.size()));
    ASSERT_EQ(st.cached, 0);
    ASSERT_GE(st.retiring, MustRetire());
    const BlockPool& states = *cache_->states();
    for (const auto& [id, m] : seqs_) {
      const Sequence* s = cache_->Find(id);
      ASSERT_NE(s, nullptr) << id;
      ASSERT_EQ(s->session, m.session);
      ASSERT_EQ(s->num_tokens, m.tokens) << id;
      ASSERT_EQ(s->tokens, std::vector<int32_t>(m.content.begin(), m.content.begin() + m.known))
          << id;
      ASSERT_EQ(s->state_slot, BlockId(m.slot)) << "sequence " << id << " changed slots";
      ASSERT_EQ(arena_[m.slot], m.state)
          << "sequence " << id << "'s state in slot " << m.slot << " was overwritten or never set";
    }
    for (int32_t s = 0; s < kStateSlots; ++s) {
      const BlockState state = states.state(BlockId(s));
      if (Live(s)) {
        ASSERT_EQ(state, BlockState::kActive) << "slot " << s;
      } else if (!Passed(s)) {
        ASSERT_EQ(state, BlockState::kRetiring) << "slot " << s << " released before its fence";
      } else {
        ASSERT_NE(state, BlockState::kActive) << "slot " << s << " held by no sequence";
      }
    }
  }

  int64_t Rand(int64_t n) { return static_cast<int64_t>(rng_() % static_cast<uint64_t>(n)); }
  int32_t Token() { return static_cast<int32_t>(rng_() % 50000); }
  SequenceId PickSequence() {
    if (seqs_.empty() || Rand(40) == 0) return SequenceId(1'000'000 + Rand(10));
    auto it = seqs_.begin();
    std::advance(it, Rand(static_cast<int64_t>(seqs_.size())));
    return it->first;
  }
  SessionId PickCaller(SequenceId id) {
    auto it = seqs_.find(id);
    if (it == seqs_.end() || Rand(40) == 0) return kSessions[Rand(2)];
    return it->second.session;
  }
  Code Ownership(SessionId caller, SequenceId id) const {
    auto it = seqs_.find(id);
    if (it == seqs_.end()) return Code::kNotFound;
    return it->second.session == caller ? Code::kOk : Code::kPermissionDenied;
  }

  // A request's prompt: none, fresh tokens, or (part of) a prompt committed earlier.
  AllocateRequest PickRequest(std::vector<int32_t>* prompt) {
    AllocateRequest r{.ns = kNamespaces[Rand(2)]};
    const int64_t kind = Rand(10);
    if (kind >= 7 && !prompts_.empty()) {
      const Prompt& p = prompts_[static_cast<size_t>(Rand(static_cast<int64_t>(prompts_.size())))];
      if (Rand(4) != 0) r.ns = p.ns;
      const int64_t keep = 1 + Rand(static_cast<int64_t>(p.tokens.size()));
      prompt->assign(p.tokens.begin(), p.tokens.begin() + keep);
      for (int64_t extra = Rand(3) * Rand(6); extra > 0; --extra) prompt->push_back(Token());
    } else if (kind >= 4) {
      for (int64_t n = 1 + Rand(32); n > 0; --n) prompt->push_back(Token());
    }
    if (static_cast<int64_t>(prompt->size()) > kMaxTokens) prompt->resize(kMaxTokens);
    const int64_t size = static_cast<int64_t>(prompt->size());
    r.num_tokens = size + Rand(kMaxTokens - size + 1);
    const int64_t odd = Rand(40);
    if (odd == 0) r.num_tokens = size - 1 - Rand(2);  // shorter than its prompt, or negative
    if (odd == 1) r.num_tokens = kMaxTokens + 1 + Rand(kBlockSize * 2);  // past the table bound
    r.prompt = *prompt;
    return r;
  }

  // Predicts a batch's code, walking it in order as the manager does (state room last).
  Code PredictAllocate(std::span<const AllocateRequest> batch) const {
    for (const AllocateRequest& r : batch) {
      if (r.num_tokens < static_cast<int64_t>(r.prompt.size())) return Code::kInvalidArgument;
      if (BlocksFor(r.num_tokens) > kMaxBlocksPerSeq) return Code::kResourceExhausted;
    }
    if (static_cast<int64_t>(batch.size()) > Available()) return Code::kResourceExhausted;
    return Code::kOk;
  }

  void StepAllocate() {
    const SessionId caller = kSessions[Rand(2)];
    const size_t n = static_cast<size_t>(1 + Rand(3));
    std::vector<std::vector<int32_t>> prompts(n);
    std::vector<AllocateRequest> batch;
    int64_t attention_match = 0;  // what the tree holds of the prompts, for full attention
    for (size_t k = 0; k < n; ++k) {
      batch.push_back(PickRequest(&prompts[k]));
      attention_match +=
          cache_->cache()->Match(batch.back().ns, batch.back().prompt).matched_tokens;
    }
    const Code want = PredictAllocate(batch);
    const int64_t short_by = static_cast<int64_t>(n) - Available();
    const std::string before = want == Code::kOk ? "" : Snapshot();
    const uint64_t missed_before = cache_->stats().missed_no_checkpoint;
    std::vector<AllocateResult> results;
    DevicePlan plan;
    const absl::Status status = cache_->AllocateBatch(caller, batch, &results, &plan);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) {
      ExpectRefused(status, before, plan, short_by);
      ASSERT_TRUE(results.empty());
      return;
    }
    ASSERT_EQ(results.size(), n);
    ASSERT_EQ(plan.state_zeros.size(), n);
    ASSERT_TRUE(plan.state_copies.empty());
    ASSERT_TRUE(plan.copies.empty()) << "a prompt adopted cached blocks";
    ASSERT_EQ(cache_->stats().missed_no_checkpoint - missed_before,
              static_cast<uint64_t>(attention_match));
    if (attention_match > 0) ++tally_.prompt_reuses;
    size_t fills = 0;
    for (size_t k = 0; k < n; ++k) {
      ASSERT_EQ(results[k].matched_tokens, 0);
      const SequenceId id = results[k].sequence;
      const BlockId slot = cache_->Find(id)->state_slot;
      ASSERT_EQ(plan.state_zeros[k], slot) << "sequence " << id << " got another slot zeroed";
      HandOut(slot);
      Seq& m = seqs_[id];
      m = Seq{.session = caller, .ns = batch[k].ns, .tokens = batch[k].num_tokens};
      m.content = prompts[k];
      m.known = static_cast<int64_t>(prompts[k].size());
      while (static_cast<int64_t>(m.content.size()) < m.tokens) m.content.push_back(Token());
      m.slot = slot.value();
      fills += static_cast<size_t>(BlocksFor(m.tokens));
    }
    ASSERT_EQ(plan.fills.size(), fills) << "every block is fresh: nothing is resumed";
    Execute(plan);
    MarkPlan(plan);
  }

  // A refused Allocate or Fork: nothing changed, and a refusal for want of slots says so.
  void ExpectRefused(const absl::Status& status, const std::string& before, const DevicePlan& plan,
                     int64_t short_by) {
    ASSERT_TRUE(plan.empty());
    ASSERT_EQ(cache_->DebugString(), before) << "a refused call changed state";
    const std::optional<Shortfall> shortfall = GetShortfall(status);
    if (shortfall && shortfall->resource == Resource::kStateSlots) {
      ASSERT_EQ(shortfall->blocks, short_by) << status;
      ++tally_.state_refusals;
    } else if (status.code() == Code::kResourceExhausted) {
      ASSERT_TRUE(shortfall.has_value()) << status;
      ASSERT_EQ(shortfall->resource, Resource::kTableBound) << status;
    }
  }

  void StepFork() {
    const SequenceId parent = PickSequence();
    const SessionId caller = PickCaller(parent);
    Code want = Ownership(caller, parent);
    if (want == Code::kOk && Available() < 1) want = Code::kResourceExhausted;
    const int64_t short_by = 1 - Available();
    const std::string before = want == Code::kOk ? "" : Snapshot();
    DevicePlan plan;
    const absl::StatusOr<SequenceId> child = cache_->Fork(caller, parent, &plan);
    ASSERT_EQ(child.status().code(), want) << child.status();
    if (!child.ok()) {
      ExpectRefused(child.status(), before, plan, short_by);
      return;
    }
    const BlockId slot = cache_->Find(*child)->state_slot;
    ASSERT_TRUE(plan.state_zeros.empty());
    ASSERT_EQ(plan.state_copies.size(), 1u);
    ASSERT_EQ(plan.state_copies[0].dst, slot) << "the copy lands in another slot than the child's";
    HandOut(slot);
    Seq m = seqs_.at(parent);
    m.slot = slot.value();
    seqs_[*child] = std::move(m);  // the parent's state, as it stands now
    ++tally_.forks;
    Execute(plan);
    MarkPlan(plan);
  }

  void StepGrow() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    auto it = seqs_.find(id);
    const int64_t current = it == seqs_.end() ? 0 : it->second.tokens;
    int64_t tokens = current + Rand(3 * kBlockSize) - kBlockSize / 2;
    if (Rand(20) == 0) tokens = Rand(2) == 0 ? -1 : kMaxTokens + 1;
    Code want = Ownership(caller, id);
    if (want == Code::kOk && tokens < 0) want = Code::kInvalidArgument;
    if (want == Code::kOk && tokens > current && BlocksFor(tokens) > kMaxBlocksPerSeq) {
      want = Code::kResourceExhausted;
    }
    const std::string before = want == Code::kOk ? "" : Snapshot();
    DevicePlan plan;
    const absl::Status status = cache_->Grow(caller, id, tokens, &plan);
    ASSERT_EQ(status.code(), want) << status;
    ASSERT_TRUE(plan.state_zeros.empty() && plan.state_copies.empty());
    if (!status.ok()) {
      ASSERT_EQ(cache_->DebugString(), before) << "a refused grow changed state";
      return;
    }
    Seq& m = it->second;
    while (m.tokens < tokens) {
      m.content.push_back(Token());
      ++m.tokens;
    }
  }

  // Rewinds below the known tokens (refused: no checkpoint), to or above them, or past the end.
  void StepTruncate() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    auto it = seqs_.find(id);
    const int64_t current = it == seqs_.end() ? 0 : it->second.tokens;
    const int64_t known = it == seqs_.end() ? 0 : it->second.known;
    int64_t tokens = 0;
    switch (Rand(8)) {
      case 0:
        tokens = current + 1 + Rand(3);
        break;
      case 1:
      case 2:
        tokens = known > 0 ? Rand(known) : -1;
        break;
      default:
        tokens = known + Rand(current - known + 1);
        break;
    }
    Code want = Ownership(caller, id);
    if (want == Code::kOk && (tokens < 0 || tokens > current)) want = Code::kInvalidArgument;
    if (want == Code::kOk && tokens < known) want = Code::kFailedPrecondition;
    const std::string before = want == Code::kOk ? "" : Snapshot();
    const absl::Status status = cache_->Truncate(caller, id, tokens);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) {
      ASSERT_EQ(cache_->DebugString(), before) << "a refused truncate changed state";
      if (want == Code::kFailedPrecondition) ++tally_.truncate_refusals;
      return;
    }
    it->second.tokens = tokens;
    it->second.content.resize(static_cast<size_t>(tokens));
  }

  // Publishes some of the sequence's tokens (telling the manager of more of them).
  void StepCommit() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    Code want = Ownership(caller, id);
    int64_t known = 0;
    int64_t upto = 0;
    std::vector<int32_t> fresh;
    if (want == Code::kOk) {
      const Seq& m = seqs_.at(id);
      known = m.known + Rand(m.tokens - m.known + 1);
      fresh.assign(m.content.begin() + m.known, m.content.begin() + known);
      upto = Rand(known + 1);
      if (Rand(15) == 0) {
        upto = known + 1;
        want = Code::kInvalidArgument;
      }
    }
    const std::string before = want == Code::kOk ? "" : Snapshot();
    const absl::Status status = cache_->Commit(caller, id, upto, fresh);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) {
      ASSERT_EQ(cache_->DebugString(), before) << "a refused commit changed state";
      return;
    }
    Seq& m = seqs_.at(id);
    m.known = known;
    Remember(m.ns, m.content, upto);
  }

  void Remember(NamespaceId ns, const std::vector<int32_t>& content, int64_t tokens) {
    if (tokens == 0) return;
    Prompt p{ns, std::vector<int32_t>(content.begin(), content.begin() + tokens)};
    if (prompts_.size() < kMaxPrompts) {
      prompts_.push_back(std::move(p));
    } else {
      prompts_[static_cast<size_t>(Rand(kMaxPrompts))] = std::move(p);
    }
  }

  void StepFree() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    const Code want = Ownership(caller, id);
    const OnFree on_free = Rand(2) == 0 ? OnFree::kCommit : OnFree::kDiscard;
    const std::string before = want == Code::kOk ? "" : Snapshot();
    const absl::Status status = cache_->Free(caller, id, on_free);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) {
      ASSERT_EQ(cache_->DebugString(), before) << "a refused free changed state";
      return;
    }
    const Seq& m = seqs_.at(id);
    if (on_free == OnFree::kCommit) Remember(m.ns, m.content, m.known);
    Forget(id);
  }

  void StepFreeSession() {
    const SessionId session = kSessions[Rand(2)];
    std::vector<SequenceId> gone;
    for (const auto& [id, m] : seqs_) {
      if (m.session == session) gone.push_back(id);
    }
    ASSERT_EQ(cache_->FreeSession(session), static_cast<int64_t>(gone.size()));
    for (SequenceId id : gone) Forget(id);
  }

  // A model step: a few live sequences' states (and their blocks) are read and written by work
  // queued up to a new fence; each write lands when that fence completes.
  void StepModel() {
    if (seqs_.empty()) return;
    const uint32_t timeline = static_cast<uint32_t>(Rand(kMaxTimelines));
    if (fences_.Outstanding(timeline) >= kMaxOutstanding) return StepComplete(timeline);
    std::vector<SequenceId> picked;
    for (int64_t n = 1 + Rand(3); n > 0; --n) {
      const SequenceId id = PickSequence();
      if (seqs_.contains(id) && std::find(picked.begin(), picked.end(), id) == picked.end()) {
        picked.push_back(id);
      }
    }
    if (picked.empty()) return;
    std::vector<BlockId> slots;
    std::vector<BlockId> blocks;
    for (SequenceId id : picked) {
      slots.push_back(BlockId(seqs_.at(id).slot));
      const std::vector<BlockId>& table = cache_->Find(id)->table;
      blocks.insert(blocks.end(), table.begin(), table.end());
    }
    const Fence fence = fences_.Issue(timeline);
    ASSERT_TRUE(cache_->MarkStatesInFlight(slots, fence).ok());
    ASSERT_TRUE(cache_->MarkInFlight(blocks, fence).ok());
    ++steps_;
    for (SequenceId id : picked) {
      const int32_t slot = seqs_.at(id).slot;
      marks_[slot][timeline] = std::max(marks_[slot][timeline], fence.value);
      // Never 0 (a zeroed state) and never the same for two sequences or two steps.
      const uint64_t value = (static_cast<uint64_t>(id.value()) << 32) | steps_;
      pending_.push_back(PendingWrite{slot, value, fence, id});
    }
  }

  // Device work on slots no sequence holds, or that do not exist, is refused and marks nothing.
  void StepBadMark() {
    std::vector<BlockId> slots;
    for (const auto& [id, m] : seqs_) {
      if (Rand(2) == 0) slots.push_back(BlockId(m.slot));
    }
    Code want = Code::kNotFound;
    BlockId bad(kStateSlots + static_cast<int32_t>(Rand(3)));
    for (int32_t s = 0; s < kStateSlots; ++s) {
      if (!Live(s) && Rand(2) == 0) {
        bad = BlockId(s);
        want = Code::kFailedPrecondition;
      }
    }
    slots.insert(slots.begin() + Rand(static_cast<int64_t>(slots.size()) + 1), bad);
    const std::string before = Snapshot();
    const Fence fence{static_cast<uint32_t>(Rand(kMaxTimelines)),
                      1 + static_cast<uint64_t>(Rand(9))};
    ASSERT_EQ(cache_->MarkStatesInFlight(slots, fence).code(), want);
    ASSERT_EQ(cache_->DebugString(), before) << "a refused mark changed state";
  }

  // Completes some of a timeline's fences (timelines finish in any order among themselves).
  void StepComplete(uint32_t timeline) {
    const uint64_t outstanding = fences_.Outstanding(timeline);
    if (outstanding == 0) return;
    fences_.Complete(timeline, fences_.completed(timeline) + 1 + rng_() % outstanding);
    Land();
  }

  // Reclaims every slot whose fences have passed, and none other.
  void StepReclaim() {
    cache_->ReclaimRetired();
    ASSERT_EQ(cache_->stats().states.retiring, MustRetire());
  }

  void Step(uint64_t dice) {
    if (dice < 150) return StepAllocate();
    if (dice < 250) return StepFork();
    if (dice < 350) return StepGrow();
    if (dice < 450) return StepTruncate();
    if (dice < 520) return StepCommit();
    if (dice < 640) return StepFree();
    if (dice < 645) return StepFreeSession();
    if (dice < 800) return StepModel();
    if (dice < 960) return StepComplete(static_cast<uint32_t>(Rand(kMaxTimelines)));
    if (dice < 985) return StepReclaim();
    return StepBadMark();
  }

  ManualClock clock_;
  TestFences fences_;
  std::unique_ptr<KvCacheManager> cache_;
  std::map<SequenceId, Seq> seqs_;
  std::array<uint64_t, kStateSlots> arena_{};  // the slots' simulated bytes
  std::array<std::array<uint64_t, kMaxTimelines>, kStateSlots> marks_{};  // since hand-out
  std::array<bool, kStateSlots> retired_{};  // released before its fences passed
  std::deque<PendingWrite> pending_;
  std::vector<Prompt> prompts_;
  uint64_t steps_ = 0;
  Tally tally_;
  std::mt19937_64 rng_{20261203};
};

TEST_F(StateGroupRandomTest, OperationsAgreeWithTheModel) {
  int64_t ops = 20'000;
  if (const char* env = std::getenv("KVPOOL_STATE_RANDOM_OPS")) ops = std::atoll(env);
  for (int64_t op = 0; op < ops; ++op) {
    clock_.Advance(1 + Rand(1000));
    Step(rng_() % 1000);
    if (HasFatalFailure()) FAIL() << "at operation " << op;
    const absl::Status invariants = cache_->CheckInvariants();
    ASSERT_TRUE(invariants.ok()) << "at operation " << op << ": " << invariants;
    Verify();
    if (HasFatalFailure()) FAIL() << "at operation " << op;
  }
  const KvCacheStats s = cache_->stats();
  std::printf(
      "ops=%lld state_refusals=%lld forks=%lld reused_after_fence=%lld truncate_refusals=%lld "
      "landed=%lld prompt_reuses=%lld missed_no_checkpoint=%llu retired=%llu\n",
      static_cast<long long>(ops), static_cast<long long>(tally_.state_refusals),
      static_cast<long long>(tally_.forks), static_cast<long long>(tally_.reused),
      static_cast<long long>(tally_.truncate_refusals), static_cast<long long>(tally_.landed),
      static_cast<long long>(tally_.prompt_reuses),
      static_cast<unsigned long long>(s.missed_no_checkpoint),
      static_cast<unsigned long long>(s.states.retired));
  // The run must have exercised what it claims to (the default run passes each by 1.5 times).
  EXPECT_GT(tally_.state_refusals, ops / 20);
  EXPECT_GT(tally_.forks, ops / 50);
  EXPECT_GT(tally_.reused, ops / 50);
  EXPECT_GT(tally_.truncate_refusals, ops / 100);
  EXPECT_GT(tally_.landed, ops / 50);
  EXPECT_GT(tally_.prompt_reuses, ops / 200);
}

}  // namespace
}  // namespace kvpool

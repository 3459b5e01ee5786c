// Seeded randomized test: at least 1,000,000 operations (allocate, grow, batched grow, truncate,
// fork, free, session teardown, commit, pins that expire by the clock, quota pressure, bad input)
// against a simple reference model (kv_cache_model.h). After every step: CheckInvariants(), the
// outcome code the model predicts, table contents mapped one-to-one onto the model's blocks, the
// pins the manager lists and the blocks they keep, and the KV a simulated arena holds for every
// sequence (so a write into a shared block, a missed copy or a missed scrub shows up as data).
// Lower tiers' events come in between, and a consumer's view built from the event log alone
// (event_mirror.h) must match the pool's snapshot, device and tiers.

#include <algorithm>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "tests/kvpool/event_mirror.h"
#include "tests/kvpool/kv_cache_model.h"

namespace kvpool {
namespace {

using namespace testing_model;  // NOLINT: the model's constants and types

class KvCacheRandomTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cache = KvCacheManager::Create({.block_size = kBlockSize,
                                         .num_blocks = kNumBlocks,
                                         .max_blocks_per_seq = kMaxBlocksPerSeq,
                                         .trace_depth = 4,
                                         .clock = &clock_,
                                         .max_pins = kMaxPins,
                                         .max_pin_ttl_ns = kMaxPinTtl,
                                         .max_pinned_blocks = kMaxPinnedBlocks});
    ASSERT_TRUE(cache.ok());
    cache_ = std::move(*cache);
    ASSERT_TRUE(cache_->SetNamespaceQuota(kNamespaces[1], kQuotaNs22).ok());
    ASSERT_TRUE(cache_->SetSessionQuota(kSessions[1], kQuotaSession2).ok());
    arena_.assign(kNumBlocks * kBlockSize, 0);
    last_owner_.assign(kNumBlocks, kNoNamespace);
  }

  uint32_t& Slot(BlockId block, int64_t token) {
    return arena_[static_cast<size_t>(block.value()) * kBlockSize + token % kBlockSize];
  }

  // Carries out a plan the way the daemon would, checking each scrub decision against the
  // owners this test has seen (Verify checks the pool's owners against the model's).
  void Execute(const DevicePlan& plan) {
    for (const BlockFill& fill : plan.fills) {
      const NamespaceId ns = cache_->pool().owner(fill.block);
      const NamespaceId last = last_owner_[fill.block.value()];
      ASSERT_EQ(fill.scrub, last != kNoNamespace && last != ns) << "block " << fill.block;
      if (fill.scrub) {
        for (int t = 0; t < kBlockSize; ++t) Slot(fill.block, t) = 0;
      }
      last_owner_[fill.block.value()] = ns;
    }
    for (const BlockCopy& copy : plan.copies) {
      ASSERT_EQ(cache_->pool().owner(copy.src), cache_->pool().owner(copy.dst));
      for (int t = 0; t < kBlockSize; ++t) Slot(copy.dst, t) = Slot(copy.src, t);
      last_owner_[copy.dst.value()] = cache_->pool().owner(copy.dst);
    }
  }

  // Writes the model's values for tokens [from, to) of `id` through its real table.
  void Write(SequenceId id, int64_t from) {
    const Model::Seq& m = model_.seqs.at(id);
    const Sequence* s = cache_->Find(id);
    for (int64_t t = from; t < m.tokens; ++t) {
      Slot(s->table[static_cast<size_t>(t / kBlockSize)], t) = m.content[static_cast<size_t>(t)];
    }
  }

  // Every sequence: same length and table shape, handles map one-to-one onto blocks, and the
  // arena holds exactly what each sequence wrote.
  void Verify() {
    ASSERT_EQ(cache_->stats().sequences, static_cast<int64_t>(model_.seqs.size()));
    // Each session's holdings list exactly its sequences (CheckInvariants recounts the rest of
    // them).
    for (SessionId session : kSessions) {
      std::vector<SequenceId> want;
      for (const auto& [id, m] : model_.seqs) {
        if (m.session == session) want.push_back(id);
      }
      const SessionHoldings* held = cache_->HoldingsOf(session);
      std::vector<SequenceId> got;
      if (held) got.assign(held->sequences.begin(), held->sequences.end());
      std::sort(got.begin(), got.end());
      ASSERT_EQ(got, want) << "session " << session;
    }
    // Blocks the model forgot are free, or cached and evictable (a pin-held one is neither).
    ASSERT_EQ(cache_->pool().num_free() + cache_->stats().cache.evictable,
              kNumBlocks - model_.Used());
    absl::flat_hash_map<int, BlockId> block_of;
    absl::flat_hash_map<BlockId, int> handle_of;
    VerifyPins(&block_of, &handle_of);
    for (const auto& [id, m] : model_.seqs) {
      const Sequence* s = cache_->Find(id);
      ASSERT_NE(s, nullptr) << id;
      ASSERT_EQ(s->num_tokens, m.tokens);
      ASSERT_EQ(s->session, m.session);
      ASSERT_EQ(s->table.size(), m.handles.size());
      for (size_t i = 0; i < m.handles.size(); ++i) {
        ASSERT_EQ(cache_->pool().owner(s->table[i]), m.ns);
        auto [it, inserted] = block_of.emplace(m.handles[i], s->table[i]);
        ASSERT_EQ(it->second, s->table[i]) << "handle " << m.handles[i] << " split across blocks";
        auto [jt, fresh] = handle_of.emplace(s->table[i], m.handles[i]);
        ASSERT_EQ(jt->second, m.handles[i]) << "block " << s->table[i] << " shared wrongly";
      }
      for (int64_t t = 0; t < m.tokens; ++t) {
        ASSERT_EQ(Slot(s->table[static_cast<size_t>(t / kBlockSize)], t),
                  m.content[static_cast<size_t>(t)])
            << "sequence " << id << " token " << t << " was overwritten";
      }
    }
  }

  // The manager lists exactly the model's pins, and every block a pin keeps is still cached.
  void VerifyPins(absl::flat_hash_map<int, BlockId>* block_of,
                  absl::flat_hash_map<BlockId, int>* handle_of) {
    const std::vector<PinInfo> listed = cache_->ListPins();
    ASSERT_EQ(listed.size(), model_.pins.size());
    size_t k = 0;
    for (const auto& [id, pin] : model_.pins) {
      const PinInfo& info = listed[k++];
      ASSERT_EQ(info.id, id);
      ASSERT_EQ(info.session, pin.session);
      ASSERT_EQ(info.blocks, static_cast<int64_t>(pin.handles.size()));
      ASSERT_EQ(info.expires_ns, pin.expires);
      for (size_t i = 0; i < pin.handles.size(); ++i) {
        const BlockId block = pin.blocks[i];
        ASSERT_TRUE(cache_->pool().cache_held(block)) << "pinned block " << block << " evicted";
        block_of->emplace(pin.handles[i], block);
        handle_of->emplace(block, pin.handles[i]);
      }
    }
    ASSERT_EQ(cache_->stats().pinned_blocks, model_.PinnedHandles());
    // Each session's own listing (from its holdings, SessionHoldings) is its part of the whole.
    for (SessionId session : kSessions) {
      std::vector<PinInfo> own;
      for (const PinInfo& info : listed) {
        if (info.session == session) own.push_back(info);
      }
      ASSERT_EQ(cache_->ListPins(session), own) << "session " << session;
    }
  }

  static std::vector<int32_t> TokensOf(const Model::Seq& m, int64_t from, int64_t to) {
    std::vector<int32_t> t;
    for (int64_t i = from; i < to; ++i) {
      t.push_back(static_cast<int32_t>(m.content[static_cast<size_t>(i)] & 0x7fffffff));
    }
    return t;
  }

  SequenceId PickSequence() {
    if (model_.seqs.empty() || rng_() % 50 == 0) return SequenceId(1'000'000 + rng_() % 10);
    auto it = model_.seqs.begin();
    std::advance(it, rng_() % model_.seqs.size());
    return it->first;
  }
  SessionId PickCaller(SequenceId id) {
    auto it = model_.seqs.find(id);
    if (it == model_.seqs.end() || rng_() % 40 == 0) return kSessions[rng_() % 2];
    return it->second.session;
  }
  int64_t PickLength(int64_t current) {
    switch (rng_() % 20) {
      case 0:
        return -1 - static_cast<int64_t>(rng_() % 3);
      case 1:
        return kMaxBlocksPerSeq * kBlockSize + 1 + static_cast<int64_t>(rng_() % 8);
      default:
        return current + static_cast<int64_t>(rng_() % (3 * kBlockSize)) - kBlockSize / 2;
    }
  }
  void StepAllocate() {
    const SessionId caller = kSessions[rng_() % 2];
    const NamespaceId ns = kNamespaces[rng_() % 2];
    const int64_t tokens = PickLength(static_cast<int64_t>(rng_() % 12));
    absl::StatusCode want = absl::StatusCode::kOk;
    if (tokens < 0) {
      want = absl::StatusCode::kInvalidArgument;
    } else if (BlocksFor(tokens) > kMaxBlocksPerSeq) {
      want = absl::StatusCode::kResourceExhausted;
    } else {
      want = model_.Capacity(ns, BlocksFor(tokens), caller, BlocksFor(tokens));
    }
    DevicePlan plan;
    const absl::StatusOr<AllocateResult> result = cache_->Allocate(caller, {ns, tokens}, &plan);
    ASSERT_EQ(result.status().code(), want) << result.status();
    if (!result.ok()) return;
    const SequenceId* id = &result->sequence;
    Model::Seq& m = model_.seqs[*id];
    m.session = caller;
    m.ns = ns;
    m.tokens = tokens;
    for (int64_t b = 0; b < BlocksFor(tokens); ++b) m.handles.push_back(model_.NewHandle(ns));
    for (int64_t t = 0; t < tokens; ++t) m.content.push_back(static_cast<uint32_t>(rng_()));
    Execute(plan);
    Write(*id, 0);
  }

  // Grows one or several sequences of one caller in one batch.
  void StepGrow(int batch) {
    std::vector<GrowRequest> requests;
    SessionId caller = kSessions[0];
    for (int k = 0; k < batch; ++k) {
      const SequenceId id = PickSequence();
      if (k == 0) caller = PickCaller(id);
      auto it = model_.seqs.find(id);
      requests.push_back({id, PickLength(it == model_.seqs.end() ? 0 : it->second.tokens)});
    }
    const absl::StatusCode want = PredictGrow(caller, requests);
    DevicePlan plan;
    const absl::Status status = cache_->GrowBatch(caller, requests, &plan);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) {
      ASSERT_TRUE(plan.empty());
      return;
    }
    const std::vector<std::pair<SequenceId, int64_t>> written = ApplyGrow(requests);
    Execute(plan);
    for (const auto& [id, from] : written) Write(id, from);
  }

  // What GrowBatch answers, walking the batch in order as the cache does: the first request's
  // error, else whether the blocks it takes (new ones, and copies of shared partial last blocks)
  // fit the quota and the pool.
  absl::StatusCode PredictGrow(SessionId caller, const std::vector<GrowRequest>& requests) {
    std::map<int, int> taken;  // references copy-on-writes earlier in the batch give up
    std::map<NamespaceId, int64_t> blocks_by_ns;
    int64_t refs = 0;
    std::map<SequenceId, bool> seen;
    for (const GrowRequest& r : requests) {
      if (const absl::StatusCode c = model_.Ownership(caller, r.sequence);
          c != absl::StatusCode::kOk) {
        return c;
      }
      if (requests.size() > 1 && seen[r.sequence]) return absl::StatusCode::kInvalidArgument;
      seen[r.sequence] = true;
      const Model::Seq& m = model_.seqs.at(r.sequence);
      if (r.num_tokens < 0) return absl::StatusCode::kInvalidArgument;
      if (r.num_tokens <= m.tokens) continue;
      if (BlocksFor(r.num_tokens) > kMaxBlocksPerSeq) return absl::StatusCode::kResourceExhausted;
      const int64_t fresh = BlocksFor(r.num_tokens) - static_cast<int64_t>(m.handles.size());
      int64_t cow = 0;
      if (m.tokens % kBlockSize != 0) {
        const int h = m.handles[static_cast<size_t>(m.tokens / kBlockSize)];
        if (model_.MustCopy(h, taken[h])) {
          cow = 1;
          ++taken[h];
        }
      }
      blocks_by_ns[m.ns] += fresh + cow;
      refs += fresh;
    }
    int64_t total = 0;
    absl::StatusCode want = absl::StatusCode::kOk;
    for (const auto& [ns, n] : blocks_by_ns) {
      if (n > 0 && ns == kNamespaces[1] && model_.ActiveIn(ns) + n > kQuotaNs22) {
        want = absl::StatusCode::kResourceExhausted;
      }
      total += n;
    }
    if (want != absl::StatusCode::kOk) return want;
    return model_.Capacity(kNamespaces[0], total, caller, refs);
  }

  // Applies a granted batch to the model in order: a shared partial last block is copied, new
  // blocks appended, new tokens given content. Returns each grown sequence with where its new
  // tokens start.
  std::vector<std::pair<SequenceId, int64_t>> ApplyGrow(const std::vector<GrowRequest>& requests) {
    std::vector<std::pair<SequenceId, int64_t>> written;
    for (const GrowRequest& r : requests) {
      Model::Seq& m = model_.seqs.at(r.sequence);
      if (r.num_tokens <= m.tokens) continue;
      if (m.tokens % kBlockSize != 0) {
        int& h = m.handles[static_cast<size_t>(m.tokens / kBlockSize)];
        if (model_.MustCopy(h, 0)) {
          model_.Drop(h);
          h = model_.NewHandle(m.ns);
        }
      }
      while (static_cast<int64_t>(m.handles.size()) < BlocksFor(r.num_tokens)) {
        m.handles.push_back(model_.NewHandle(m.ns));
      }
      written.emplace_back(r.sequence, m.tokens);
      while (m.tokens < r.num_tokens) {
        m.content.push_back(static_cast<uint32_t>(rng_()));
        ++m.tokens;
      }
    }
    return written;
  }

  void StepTruncate() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    auto it = model_.seqs.find(id);
    const int64_t current = it == model_.seqs.end() ? 0 : it->second.tokens;
    const int64_t tokens =
        rng_() % 10 == 0 ? current + 1 : current - static_cast<int64_t>(rng_() % (current + 1));
    absl::StatusCode want = model_.Ownership(caller, id);
    if (want == absl::StatusCode::kOk && (tokens < 0 || tokens > current)) {
      want = absl::StatusCode::kInvalidArgument;
    }
    const absl::Status status = cache_->Truncate(caller, id, tokens);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) return;
    Model::Seq& m = it->second;
    while (static_cast<int64_t>(m.handles.size()) > BlocksFor(tokens)) {
      model_.Drop(m.handles.back());
      m.handles.pop_back();
    }
    m.tokens = tokens;
    m.content.resize(static_cast<size_t>(tokens));
    m.known = std::min(m.known, tokens);
    m.published_full = std::min(m.published_full, tokens / kBlockSize);
  }

  void StepFork() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    absl::StatusCode want = model_.Ownership(caller, id);
    if (want == absl::StatusCode::kOk) {
      const Model::Seq& m = model_.seqs.at(id);
      const int64_t partial = m.tokens % kBlockSize != 0 ? 1 : 0;
      want = model_.Capacity(m.ns, partial, caller, static_cast<int64_t>(m.handles.size()));
    }
    DevicePlan plan;
    const absl::StatusOr<SequenceId> child = cache_->Fork(caller, id, &plan);
    ASSERT_EQ(child.status().code(), want) << child.status();
    if (!child.ok()) return;
    Model::Seq copy = model_.seqs.at(id);
    for (size_t i = 0; i < copy.handles.size(); ++i) {
      if (i + 1 == copy.handles.size() && copy.tokens % kBlockSize != 0) {
        copy.handles[i] = model_.NewHandle(copy.ns);
      } else {
        ++model_.handles.at(copy.handles[i]).refs;
      }
    }
    model_.seqs[*child] = std::move(copy);
    Execute(plan);
  }

  void StepFree() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    const absl::StatusCode want = model_.Ownership(caller, id);
    ASSERT_EQ(cache_->Free(caller, id).code(), want);
    if (want != absl::StatusCode::kOk) return;
    for (int h : model_.seqs.at(id).handles) model_.Drop(h);
    model_.seqs.erase(id);
  }

  void StepFreeSession() {
    const SessionId session = kSessions[rng_() % 2];
    int64_t expected = 0;
    for (auto it = model_.seqs.begin(); it != model_.seqs.end();) {
      if (it->second.session != session) {
        ++it;
        continue;
      }
      for (int h : it->second.handles) model_.Drop(h);
      it = model_.seqs.erase(it);
      ++expected;
    }
    for (auto it = model_.pins.begin(); it != model_.pins.end();) {
      const PinId pin = it->first;
      ++it;
      if (model_.pins.at(pin).session == session) model_.ReleasePin(pin);
    }
    ASSERT_EQ(cache_->FreeSession(session), expected);
    // FreeSession forgets the session's quota; the model assumes it stays.
    ASSERT_TRUE(cache_->SetSessionQuota(kSessions[1], kQuotaSession2).ok());
  }

  // Publishes the sequence's whole blocks (a partial one would make its tree path depend on its
  // siblings', which the model does not follow).
  void StepCommit() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    const absl::StatusCode want = model_.Ownership(caller, id);
    int64_t upto = 0;
    std::vector<int32_t> fresh;
    if (want == absl::StatusCode::kOk) {
      const Model::Seq& m = model_.seqs.at(id);
      upto = m.tokens / kBlockSize * kBlockSize;
      fresh = TokensOf(m, m.known, m.tokens);
    }
    const absl::Status status = cache_->Commit(caller, id, upto, fresh);
    ASSERT_EQ(status.code(), want) << status;
    if (!status.ok()) return;
    Model::Seq& m = model_.seqs.at(id);
    m.known = m.tokens;
    m.published_full = upto / kBlockSize;
    for (int64_t b = 0; b < m.published_full; ++b) {
      model_.handles.at(m.handles[static_cast<size_t>(b)]).published = true;
    }
  }

  void StepPin() {
    const SequenceId id = PickSequence();
    const SessionId caller = PickCaller(id);
    int64_t ttl = 1 + static_cast<int64_t>(rng_() % 3000);
    if (rng_() % 30 == 0) ttl = rng_() % 2 == 0 ? 0 : kMaxPinTtl + 1;
    const int priority = rng_() % 40 == 0 ? kNumPriorities : static_cast<int>(rng_() % 2);
    std::vector<int> handles;
    const absl::StatusCode want = model_.PinOutcome(caller, id, ttl, priority, &handles);
    cache_->ExpirePins();  // nothing due (the model expired it): the snapshot stays exact
    const std::string before = want == absl::StatusCode::kOk ? "" : cache_->DebugString();
    const absl::StatusOr<PinId> pin = cache_->PinSequence(caller, id, ttl, priority);
    ASSERT_EQ(pin.status().code(), want) << pin.status();
    if (!pin.ok()) {
      ASSERT_EQ(cache_->DebugString(), before) << "a refused pin changed state";
      return;
    }
    Model::Pin& p = model_.pins[*pin];
    p.session = caller;
    p.handles = handles;
    p.expires = clock_.NowNanos() + ttl;
    const Sequence* seq = cache_->Find(id);
    for (size_t i = 0; i < handles.size(); ++i) {
      p.blocks.push_back(seq->table[i]);
      ++model_.handles.at(handles[i]).refs;
    }
  }

  void StepUnpinOrRenew() {
    PinId id(1'000'000 + rng_() % 10);
    SessionId caller = kSessions[rng_() % 2];
    if (!model_.pins.empty() && rng_() % 10 != 0) {
      auto it = model_.pins.begin();
      std::advance(it, rng_() % model_.pins.size());
      id = it->first;
      if (rng_() % 20 != 0) caller = it->second.session;
    }
    auto it = model_.pins.find(id);
    absl::StatusCode want = absl::StatusCode::kOk;
    if (it == model_.pins.end()) {
      want = absl::StatusCode::kNotFound;
    } else if (it->second.session != caller) {
      want = absl::StatusCode::kPermissionDenied;
    }
    if (rng_() % 3 == 0) {
      const int64_t ttl = 1 + static_cast<int64_t>(rng_() % 3000);
      ASSERT_EQ(cache_->RenewPin(caller, id, ttl).code(), want);
      if (want == absl::StatusCode::kOk) it->second.expires = clock_.NowNanos() + ttl;
    } else {
      ASSERT_EQ(cache_->Unpin(caller, id).code(), want);
      if (want == absl::StatusCode::kOk) model_.ReleasePin(id);
    }
  }

  // A lower tier's event, as the tiers tell them (one block; its parent, often the block before:
  // runs of a chain): the mirror holds the tiers' blocks beside the device's, and the snapshot
  // must restate them. Its own generator, so the device's operations are the same with or
  // without it.
  // Moves the namespaces between quotas while they hold blocks and pins, without changing what
  // the model predicts: 11 goes between no quota, its own and two groups, all too large to bind;
  // 22 between its own quota and a group it is alone in, of the same bound. CheckInvariants then
  // recounts every quota's running totals (KvCacheManager::CheckQuotaTotals).
  void StepQuotaGroups() {
    const uint64_t dice = quota_rng_() % 6;
    if (dice < 4) {
      constexpr int64_t kLoose = int64_t{1} << 40;
      const int64_t bound = dice == 0 ? kUnlimited : kLoose;
      const uint64_t group = dice < 2 ? 0 : 0x1100 + dice;
      ASSERT_TRUE(cache_->SetNamespaceQuota(kNamespaces[0], bound, group).ok());
    } else {
      const uint64_t group = dice == 4 ? 0 : 0x2200;
      ASSERT_TRUE(cache_->SetNamespaceQuota(kNamespaces[1], kQuotaNs22, group).ok());
    }
  }

  void StepTierEvent() {
    const size_t m = tier_rng_() % 2;
    const uint64_t k = tier_rng_() % 48;
    const auto hash = [](uint64_t i) { return BlockHash{.lo = i, .hi = 0x7137}; };
    const bool held = tier_held_[m].contains(k);
    KvEvent e{.type = held ? KvEventType::kBlockRemoved : KvEventType::kBlockStored,
              .ns = kNamespaces[(k / 8) % 2],
              .block_hashes = {hash(k + 1)},
              .block_size = kBlockSize,
              .medium = m == 0 ? KvMedium::kHost : KvMedium::kDisk};
    if (!held && k % 8 != 0 && tier_rng_() % 4 != 0) e.parent_hash = hash(k);
    ASSERT_TRUE(cache_->AppendTierEvent(std::move(e)).ok());
    if (held) {
      tier_held_[m].erase(k);
    } else {
      tier_held_[m].insert(k);
    }
  }

  ManualClock clock_;
  std::unique_ptr<KvCacheManager> cache_;
  Model model_;
  std::vector<uint32_t> arena_;
  std::vector<NamespaceId> last_owner_;
  std::mt19937_64 rng_{20261129};
  std::mt19937_64 tier_rng_{20261206};
  std::mt19937_64 quota_rng_{20261207};  // its own stream: the other steps' draws stay as they were
  std::set<uint64_t> tier_held_[2];      // host, disk
  EventMirror mirror_{/*grouped=*/false};
};

TEST_F(KvCacheRandomTest, MillionOperationsAgreeWithTheModel) {
  int64_t ops = 1'000'000;
  if (const char* env = std::getenv("KVPOOL_RANDOM_OPS")) ops = std::atoll(env);
  std::map<std::string, int64_t> outcomes;
  for (int64_t step = 0; step < ops; ++step) {
    clock_.Advance(rng_() % 500 == 0 ? 2000 : 1);
    model_.ExpirePins(clock_.NowNanos());  // what the next call does first
    if (rng_() % 2 == 0) cache_->ExpirePins();
    const uint64_t dice = rng_() % 1000;
    // Keep the population near the pool's size so exhaustion and quotas come up often.
    const bool crowded = model_.seqs.size() > 14;
    if (dice < (crowded ? 60 : 170)) {
      StepAllocate();
    } else if (dice < 480) {
      StepGrow(1);
    } else if (dice < 570) {
      StepGrow(2 + static_cast<int>(rng_() % 3));
    } else if (dice < 690) {
      StepTruncate();
    } else if (dice < 780) {
      StepFork();
    } else if (dice < 850) {
      StepCommit();
    } else if (dice < 890) {
      StepPin();
    } else if (dice < 910) {
      StepUnpinOrRenew();
    } else if (dice < 998) {
      StepFree();
    } else {
      StepFreeSession();
    }
    if (tier_rng_() % 16 == 0) StepTierEvent();
    if (quota_rng_() % 32 == 0) StepQuotaGroups();
    if (HasFatalFailure()) FAIL() << "at step " << step;
    const absl::Status invariants = cache_->CheckInvariants();
    ASSERT_TRUE(invariants.ok()) << "at step " << step << ": " << invariants;
    Verify();
    if (HasFatalFailure()) FAIL() << "at step " << step;
    ASSERT_TRUE(mirror_.Follow(*cache_->events())) << "at step " << step;
    if (step % 64 == 0) {
      uint64_t resume = 0;
      ASSERT_TRUE(mirror_.Matches(cache_->SnapshotEvents(&resume))) << "at step " << step;
    }
  }
  const KvCacheStats s = cache_->stats();
  // The run must have exercised what it claims to (a tenth of these at 1M operations).
  const uint64_t n = static_cast<uint64_t>(ops);
  EXPECT_GT(s.exhausted, n / 1000);
  EXPECT_GT(s.cow_copies, n / 1000);
  EXPECT_GT(s.pool.scrubs, n / 1000);
  EXPECT_GT(s.fork_calls, n / 20);
  EXPECT_GT(s.pins_made, n / 200);
  EXPECT_GT(s.pins_expired, n / 2000);
  EXPECT_GT(s.evictions, n / 1000);  // published blocks made room for new ones
  std::printf(
      "ops=%lld allocated=%llu exhausted=%llu cow=%llu scrubs=%llu evictions=%llu "
      "pins=%llu expired=%llu\n",
      static_cast<long long>(ops), static_cast<unsigned long long>(s.pool.allocated),
      static_cast<unsigned long long>(s.exhausted), static_cast<unsigned long long>(s.cow_copies),
      static_cast<unsigned long long>(s.pool.scrubs), static_cast<unsigned long long>(s.evictions),
      static_cast<unsigned long long>(s.pins_made),
      static_cast<unsigned long long>(s.pins_expired));
}

}  // namespace
}  // namespace kvpool

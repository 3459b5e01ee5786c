// Seeded randomized test of the prefix cache together with the pool: allocate with prefix match,
// decode, commit (full and partial blocks), truncate (rewind), fork, free with and without
// commit, evict, across two namespaces and two sessions, on a pool small enough that eviction
// and exhaustion happen all the time.
//
// KV is simulated as what causal attention makes it: the value at position p is a hash of the
// namespace and tokens [0, p]. After every step every live sequence reads its KV back through
// its block table, and every hit is checked the same way, so a wrong match, a block adopted past
// its coverage, a missed copy-on-write or a write into published tokens shows up as data. The
// invariants of the pool, the tree and the manager are checked after every step; a refused call
// must leave the state unchanged. Pins come and go (by prefix and by sequence, expiring by the
// clock): the manager must list exactly the model's, and a pinned prefix must stay wholly cached
// until its pin ends. Runs once per eviction policy.

#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/errors.h"

namespace kvpool {
namespace {

constexpr int32_t kBs = 4;
constexpr int32_t kNumBlocks = 40;
constexpr int32_t kMaxBlocksPerSeq = 12;
constexpr SessionId kSessions[] = {SessionId(1), SessionId(2)};
constexpr NamespaceId kNamespaces[] = {NamespaceId(11), NamespaceId(22)};
constexpr int32_t kMaxPins = 4;

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdULL;
}

struct Live {
  SessionId session;
  NamespaceId ns;
  std::vector<int32_t> tokens;  // computed (their KV is written)
  size_t known = 0;             // how many of them the manager knows
};

// A pin as the model knows it: the tokens it keeps cached, in which namespace, until when.
struct ModelPin {
  SessionId session;
  NamespaceId ns;
  std::vector<int32_t> tokens;
  int64_t expires = 0;
};

// An eviction spec, and whether the cache records events (off, as in kvpool-replay, plain LRU
// leaves the chained hashes uncomputed).
// With `shares`, the two namespaces are two eviction shares of different weights (fair eviction
// by tenant), and the second one moves to a third share halfway, so paths cross shares.
struct RandomParams {
  const char* policy;
  bool events = true;
  bool shares = false;
};

class PrefixCacheRandomTest : public ::testing::TestWithParam<RandomParams> {
 protected:
  void SetUp() override {
    auto cache = KvCacheManager::Create({.block_size = kBs,
                                         .num_blocks = kNumBlocks,
                                         .max_blocks_per_seq = kMaxBlocksPerSeq,
                                         .trace_depth = 4,
                                         .clock = &clock_,
                                         .eviction_policy = GetParam().policy,
                                         .eviction_shares = GetParam().shares ? 3 : 0,
                                         .event_capacity = 64,
                                         .cache_events = GetParam().events,
                                         .evicted_memory = GetParam().events ? size_t{65536} : 0,
                                         .max_pins = kMaxPins,
                                         .max_pin_ttl_ns = 400,
                                         .max_pinned_blocks = kNumBlocks});
    ASSERT_TRUE(cache.ok());
    cache_ = std::move(*cache);
    if (GetParam().shares) {
      ASSERT_TRUE(cache_->SetEvictionShare(kNamespaces[0], 1, 1).ok());
      ASSERT_TRUE(cache_->SetEvictionShare(kNamespaces[1], 2, 2).ok());
    }
    arena_.assign(kNumBlocks * kBs, 0);
  }

  // The KV of position p of a sequence with these tokens.
  static uint64_t Kv(NamespaceId ns, const std::vector<int32_t>& tokens, size_t p) {
    uint64_t h = Mix(0, ns.value());
    for (size_t i = 0; i <= p; ++i) h = Mix(h, static_cast<uint64_t>(tokens[i]));
    return h;
  }

  uint64_t& Slot(SequenceId id, size_t p) {
    const BlockId b = cache_->Find(id)->table[p / kBs];
    return arena_[static_cast<size_t>(b.value()) * kBs + p % kBs];
  }

  void Execute(const DevicePlan& plan) {
    for (const BlockFill& f : plan.fills) {
      for (int t = 0; t < kBs; ++t) {
        // Scrubbed blocks are zeroed; others keep stale bytes (the fill policy "none").
        if (f.scrub) arena_[static_cast<size_t>(f.block.value()) * kBs + t] = 0;
      }
    }
    for (const BlockCopy& c : plan.copies) {
      for (int t = 0; t < kBs; ++t) {
        arena_[static_cast<size_t>(c.dst.value()) * kBs + t] =
            arena_[static_cast<size_t>(c.src.value()) * kBs + t];
      }
    }
  }

  void Compute(SequenceId id, size_t from) {
    const Live& s = live_.at(id);
    for (size_t p = from; p < s.tokens.size(); ++p) Slot(id, p) = Kv(s.ns, s.tokens, p);
  }

  void VerifyAll() {
    ASSERT_EQ(cache_->stats().sequences, static_cast<int64_t>(live_.size()));
    for (const auto& [id, s] : live_) {
      const Sequence* seq = cache_->Find(id);
      ASSERT_NE(seq, nullptr);
      ASSERT_GE(seq->num_tokens, static_cast<int64_t>(s.tokens.size()));
      // Incremental rolling hash: O(tokens) per sequence.
      uint64_t h = Mix(0, s.ns.value());
      for (size_t p = 0; p < s.tokens.size(); ++p) {
        h = Mix(h, static_cast<uint64_t>(s.tokens[p]));
        ASSERT_EQ(Slot(id, p), h) << "sequence " << id << " position " << p << " of "
                                  << s.tokens.size();
      }
    }
  }

  std::vector<int32_t> Prompt() {
    // A few shared openings (system prompts) and a small alphabet: prefixes collide often,
    // including inside blocks.
    std::vector<int32_t> p;
    const int opening = static_cast<int>(rng_() % 4);
    for (int i = 0; i < opening * 3; ++i) p.push_back(100 + opening * 10 + i % 7);
    const int tail = static_cast<int>(rng_() % 12);
    for (int i = 0; i < tail; ++i) p.push_back(static_cast<int32_t>(rng_() % 3));
    return p;
  }

  SequenceId Pick() {
    auto it = live_.begin();
    std::advance(it, rng_() % live_.size());
    return it->first;
  }

  void StepAllocate() {
    const SessionId session = kSessions[rng_() % 2];
    const NamespaceId ns = kNamespaces[rng_() % 2];
    const std::vector<int32_t> prompt = Prompt();
    const int64_t room = static_cast<int64_t>(prompt.size() + rng_() % 6);
    cache_->ExpirePins();  // housekeeping now, so that a refusal must change nothing at all
    const std::string before = cache_->DebugString();
    DevicePlan plan;
    const absl::StatusOr<AllocateResult> r = cache_->Allocate(
        session, {.ns = ns, .num_tokens = room, .prompt = prompt, .priority = int(rng_() % 2)},
        &plan);
    if (!r.ok()) {
      ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
      ASSERT_EQ(cache_->DebugString(), before) << "a refused allocate changed state";
      ++refused_;
      return;
    }
    ASSERT_LE(r->matched_tokens, static_cast<int64_t>(prompt.size()));
    Execute(plan);
    Live& s = live_[r->sequence];
    s = Live{session, ns, prompt, prompt.size()};
    // The reused KV must be exactly what computing the prompt would have produced.
    uint64_t h = Mix(0, ns.value());
    for (size_t p = 0; p < static_cast<size_t>(r->matched_tokens); ++p) {
      h = Mix(h, static_cast<uint64_t>(prompt[p]));
      ASSERT_EQ(Slot(r->sequence, p), h) << "hit of " << r->matched_tokens << " at " << p;
    }
    hits_ += r->matched_tokens;
    Compute(r->sequence, static_cast<size_t>(r->matched_tokens));
  }

  void StepDecode() {
    const SequenceId id = Pick();
    Live& s = live_.at(id);
    const int steps = 1 + static_cast<int>(rng_() % 4);
    for (int i = 0; i < steps; ++i) {
      const Sequence* seq = cache_->Find(id);
      if (static_cast<int64_t>(s.tokens.size()) == seq->num_tokens) {
        DevicePlan plan;
        const absl::Status st =
            cache_->Grow(s.session, id, seq->num_tokens + 1 + rng_() % 3, &plan);
        if (!st.ok()) {
          ASSERT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
          ++refused_;
          return;
        }
        Execute(plan);
      }
      s.tokens.push_back(static_cast<int32_t>(rng_() % 3));
      Compute(id, s.tokens.size() - 1);
    }
  }

  void StepCommit() {
    const SequenceId id = Pick();
    Live& s = live_.at(id);
    const size_t n = s.known + rng_() % (s.tokens.size() - s.known + 1);
    const size_t upto = std::max(n, s.known);
    const std::span<const int32_t> fresh(s.tokens.data() + s.known, upto - s.known);
    ASSERT_TRUE(
        cache_->Commit(s.session, id, static_cast<int64_t>(rng_() % (upto + 1)), fresh).ok());
    s.known = upto;
  }

  void StepTruncate() {
    const SequenceId id = Pick();
    Live& s = live_.at(id);
    const size_t n = rng_() % (s.tokens.size() + 1);
    ASSERT_TRUE(cache_->Truncate(s.session, id, static_cast<int64_t>(n)).ok());
    s.tokens.resize(n);
    s.known = std::min(s.known, n);
  }

  void StepFork() {
    const SequenceId id = Pick();
    const Live s = live_.at(id);
    // Fork copies the whole sequence, including reserved room: trim it first so the child's
    // length is what it computed.
    ASSERT_TRUE(cache_->Truncate(s.session, id, static_cast<int64_t>(s.tokens.size())).ok());
    DevicePlan plan;
    const absl::StatusOr<SequenceId> child = cache_->Fork(s.session, id, &plan);
    if (!child.ok()) {
      ASSERT_EQ(child.status().code(), absl::StatusCode::kResourceExhausted) << child.status();
      ++refused_;
      return;
    }
    Execute(plan);
    live_[*child] = s;
  }

  void StepFree() {
    const SequenceId id = Pick();
    const Live s = live_.at(id);
    const OnFree mode = rng_() % 3 == 0 ? OnFree::kDiscard : OnFree::kCommit;
    ASSERT_TRUE(cache_->Free(s.session, id, mode).ok());
    live_.erase(id);
  }

  // Pins a prompt's prefix, or what a live sequence published.
  void StepPin() {
    const SessionId session = kSessions[rng_() % 2];
    const int64_t ttl = 1 + static_cast<int64_t>(rng_() % 300);
    const int priority = static_cast<int>(rng_() % 2);
    ModelPin pin{.session = session, .expires = clock_.NowNanos() + ttl};
    absl::StatusOr<PinId> id;
    cache_->ExpirePins();
    const std::string before = cache_->DebugString();
    if (live_.empty() || rng_() % 2 == 0) {
      pin.ns = kNamespaces[rng_() % 2];
      pin.tokens = Prompt();
      const bool cached = !pin.tokens.empty() && cache_->MatchPrefix(pin.ns, pin.tokens) ==
                                                     static_cast<int64_t>(pin.tokens.size());
      id = cache_->PinPrefix(session, pin.ns, pin.tokens, ttl, priority);
      if (pin.tokens.empty()) {
        ASSERT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
      } else if (!cached) {
        ASSERT_EQ(id.status().code(), absl::StatusCode::kNotFound) << id.status();
      }
    } else {
      const SequenceId seq = Pick();
      const Live& s = live_.at(seq);
      const Sequence* real = cache_->Find(seq);
      const bool published = !real->path.full.empty() || real->path.partial != kInvalidBlock;
      id = cache_->PinSequence(s.session, seq, ttl, priority);
      pin.session = s.session;
      pin.ns = s.ns;
      if (!published) {
        ASSERT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << id.status();
      } else if (id.ok()) {
        // The tokens it keeps for sure: its full blocks (the partial one may be a wider
        // sibling's, whose tokens the test does not know).
        const int64_t n = std::min<int64_t>(static_cast<int64_t>(real->path.full.size()) * kBs,
                                            static_cast<int64_t>(s.known));
        pin.tokens.assign(s.tokens.begin(), s.tokens.begin() + n);
      }
    }
    if (id.ok()) {
      ASSERT_LT(pins_.size(), static_cast<size_t>(kMaxPins));
      pins_[*id] = std::move(pin);
      return;
    }
    if (id.status().code() == absl::StatusCode::kResourceExhausted) {
      ASSERT_EQ(pins_.size(), static_cast<size_t>(kMaxPins)) << id.status();
    }
    ASSERT_EQ(cache_->DebugString(), before) << "a refused pin changed state";
    ++refused_;
  }

  void StepUnpin() {
    if (pins_.empty()) return;
    auto it = pins_.begin();
    std::advance(it, rng_() % pins_.size());
    const bool owner = rng_() % 8 != 0;
    const SessionId caller =
        owner ? it->second.session
              : (it->second.session == kSessions[0] ? kSessions[1] : kSessions[0]);
    const absl::Status status = cache_->Unpin(caller, it->first);
    ASSERT_EQ(status.code(), owner ? absl::StatusCode::kOk : absl::StatusCode::kPermissionDenied);
    if (owner) pins_.erase(it);
  }

  // What the manager does first in every call: pins whose time is up end.
  void ExpireModelPins() {
    for (auto it = pins_.begin(); it != pins_.end();) {
      it = it->second.expires <= clock_.NowNanos() ? pins_.erase(it) : std::next(it);
    }
  }

  // The manager lists exactly the live pins, and each keeps its prefix wholly cached.
  void VerifyPins() {
    ExpireModelPins();
    const std::vector<PinInfo> listed = cache_->ListPins();
    ASSERT_EQ(listed.size(), pins_.size());
    size_t k = 0;
    for (const auto& [id, pin] : pins_) {
      ASSERT_EQ(listed[k].id, id);
      ASSERT_EQ(listed[k].session, pin.session);
      ASSERT_EQ(listed[k++].expires_ns, pin.expires);
      ASSERT_EQ(cache_->MatchPrefix(pin.ns, pin.tokens), static_cast<int64_t>(pin.tokens.size()))
          << "pin " << id << " lost part of its prefix";
    }
  }

  ManualClock clock_;
  std::unique_ptr<KvCacheManager> cache_;
  std::map<PinId, ModelPin> pins_;
  std::vector<uint64_t> arena_;
  std::map<SequenceId, Live> live_;
  std::mt19937_64 rng_{1129};
  int64_t hits_ = 0;
  int64_t refused_ = 0;
};

TEST_P(PrefixCacheRandomTest, TreeAndPoolAgreeWithComputedKv) {
  // The default policy gets the full run; the others a shorter one each.
  int64_t ops = std::string(GetParam().policy) == kDefaultEvictionSpec && !GetParam().shares
                    ? 100'000
                    : 40'000;
  if (const char* env = std::getenv("KVPOOL_RANDOM_OPS")) ops = std::atoll(env) / 5;
  for (int64_t step = 0; step < ops; ++step) {
    clock_.Advance(1);
    if (GetParam().shares && step == ops / 2) {
      ASSERT_TRUE(cache_->SetEvictionShare(kNamespaces[1], 3, 1).ok());
    }
    ExpireModelPins();
    const uint64_t dice = rng_() % 100;
    if (live_.empty() || dice < 24) {
      StepAllocate();
    } else if (dice < 48) {
      StepDecode();
    } else if (dice < 62) {
      StepCommit();
    } else if (dice < 70) {
      StepTruncate();
    } else if (dice < 76) {
      StepFork();
    } else if (dice < 94) {
      StepFree();
    } else if (dice < 96) {
      StepPin();
    } else if (dice < 97) {
      StepUnpin();
    } else if (dice < 99) {
      cache_->EvictCached(1 + static_cast<int64_t>(rng_() % 4));
    } else {
      const std::vector<int32_t> p = Prompt();
      (void)cache_->ExplainMatch(kNamespaces[rng_() % 2], p);
    }
    if (HasFatalFailure()) FAIL() << "at step " << step;
    const absl::Status invariants = cache_->CheckInvariants();
    ASSERT_TRUE(invariants.ok()) << "at step " << step << ": " << invariants;
    VerifyAll();
    VerifyPins();
    if (HasFatalFailure()) FAIL() << "at step " << step;
  }
  const KvCacheStats s = cache_->stats();
  std::printf(
      "ops=%lld hit_tokens=%lld refused=%lld evictions=%llu cow=%llu widened=%llu "
      "dominated=%llu nodes=%lld\n",
      static_cast<long long>(ops), static_cast<long long>(hits_), static_cast<long long>(refused_),
      static_cast<unsigned long long>(s.evictions), static_cast<unsigned long long>(s.cow_copies),
      static_cast<unsigned long long>(s.cache.widened),
      static_cast<unsigned long long>(s.cache.dominated), static_cast<long long>(s.cache.nodes));
  // The run must have exercised what it claims to.
  EXPECT_GT(hits_, ops / 4);
  EXPECT_GT(refused_, ops / 1000);
  EXPECT_GT(s.evictions, static_cast<uint64_t>(ops / 100));
  EXPECT_GT(s.cache.widened, static_cast<uint64_t>(ops / 1000));
  EXPECT_GT(s.cache.dominated, 0u);
  EXPECT_GT(s.pins_made, static_cast<uint64_t>(ops / 200));
  EXPECT_GT(s.pins_expired, static_cast<uint64_t>(ops / 2000));
}

INSTANTIATE_TEST_SUITE_P(Policies, PrefixCacheRandomTest,
                         ::testing::Values(RandomParams{kDefaultEvictionSpec.data()},
                                           RandomParams{"lru"}, RandomParams{"reuse+admit"},
                                           RandomParams{"lru", /*events=*/false},
                                           RandomParams{"reuse", /*events=*/false},
                                           RandomParams{kDefaultEvictionSpec.data(), true, true},
                                           RandomParams{"lru", /*events=*/false, true}));

}  // namespace
}  // namespace kvpool

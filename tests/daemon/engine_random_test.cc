// Seeded randomized test of the Engine: sessions open and end (detached or lost) at random
// points; they allocate, grow, truncate, fork, commit and free, run prefill and decode steps
// (chunked, batched across sessions), give up on calls before or while they run, and call after
// their session ended. The reference model follows what each call's outcome says it did; after
// every operation CheckInvariants() holds and the engine's sequences are exactly the model's
// (same owners, same lengths: nothing leaked, nothing lost; no promotion's loader outlives its
// call). A host tier sits under the pool, and operators evict now and then, so evicted prefixes
// come back through promotions. Once every session has ended, free + cached == total.

#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/internal/step_executor_of.h"
#include "gtest/gtest.h"
#include "model/model.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using testing::GivesUpAfter;

// 100k in the release tree; $KVPOOL_RANDOM_OPS sets fewer where each costs more (sanitizers).
int Operations() {
  if (const char* env = std::getenv("KVPOOL_RANDOM_OPS")) return std::atoi(env);
  return 100'000;
}
constexpr int32_t kVocab = testing::kMicroVocab;

class EngineRandomTest : public ::testing::Test {
 protected:
  struct Seq {
    SessionId owner;
    int64_t tokens = 0;
  };

  void SetUp() override {
    EngineOptions options = testing::SmallPool(0);
    options.pools[0].layout = {.block_size = 4,
                               .num_layers = 1,
                               .num_kv_heads = 1,
                               .head_dim = 16,
                               .dtype = kernels::DType::kF32,
                               .num_blocks = 64};
    options.max_blocks_per_seq = 24;
    options.session_quota_blocks = 40;
    // A host tier under the pool: evicted prefixes come back through promotions (and their holds).
    options.tiers.host_blocks = 256;
    model_ = testing::MicroModel(options.pools[0].layout);
    engine_ = std::move(*Engine::Create(options, &device_, model_.get()));
  }

  int Rand(int n) { return static_cast<int>(rng_() % static_cast<uint32_t>(n)); }
  bool Chance(int percent) { return Rand(100) < percent; }

  std::vector<int32_t> Tokens(int n) {
    // Few distinct prefixes, so prompts share cached blocks.
    std::vector<int32_t> out(static_cast<size_t>(n));
    const int base = Rand(3);
    for (int i = 0; i < n; ++i)
      out[static_cast<size_t>(i)] = (base * 7 + i * (i < 12 ? 1 : base + 2)) % kVocab;
    return out;
  }

  // A live session (opening one when none is), or, now and then, one that has ended.
  std::shared_ptr<const Session> AnySession() {
    if (!ended_.empty() && Chance(3))
      return ended_[static_cast<size_t>(Rand(static_cast<int>(ended_.size())))];
    if (live_.empty() || (live_.size() < 4 && Chance(2))) {
      live_.push_back(*engine_->OpenSession(testing::Spec("t" + std::to_string(Rand(2)))));
    }
    return live_[static_cast<size_t>(Rand(static_cast<int>(live_.size())))];
  }
  // One of `s`'s sequences in the model, or a made-up id.
  SequenceId SequenceOf(const Session& s) {
    std::vector<SequenceId> mine;
    for (const auto& [id, seq] : model_seqs_) {
      if (seq.owner == s.id) mine.push_back(id);
    }
    if (mine.empty() || Chance(3)) return SequenceId(900000 + static_cast<uint64_t>(Rand(5)));
    return mine[static_cast<size_t>(Rand(static_cast<int>(mine.size())))];
  }
  std::unique_ptr<CallContext> Context() {
    if (Chance(4)) {
      auto c = std::make_unique<ManualCallContext>();
      c->Cancel();
      return c;
    }
    if (Chance(4)) return std::make_unique<GivesUpAfter>(1);
    return std::make_unique<GivesUpAfter>(1000);
  }

  void EndSession() {
    if (live_.empty()) return;
    const size_t i = static_cast<size_t>(Rand(static_cast<int>(live_.size())));
    const std::shared_ptr<const Session> s = live_[i];
    engine_->EndSession(s->id, Chance(50) ? SessionEnd::kDetached : SessionEnd::kConnectionLost);
    live_.erase(live_.begin() + static_cast<ptrdiff_t>(i));
    ended_.push_back(s);
    std::erase_if(model_seqs_, [&](const auto& e) { return e.second.owner == s->id; });
  }

  void AddSlices(const Session& s, const Tables& t) {
    for (const TableSlice& slice : t.slices) model_seqs_[slice.sequence] = {s.id, slice.num_tokens};
  }

  void ControlCall() {
    const std::shared_ptr<const Session> s = AnySession();
    const std::unique_ptr<CallContext> context = Context();
    switch (Rand(6)) {
      case 0: {
        std::vector<std::vector<int32_t>> prompts;
        std::vector<AllocateRequest> items;
        for (int k = 1 + Rand(2); k > 0; --k) prompts.push_back(Tokens(Rand(30)));
        for (const auto& p : prompts) {
          items.push_back({.num_tokens = static_cast<int64_t>(p.size()) + Rand(10), .prompt = p});
        }
        if (absl::StatusOr<Tables> t = engine_->Allocate(*s, items, *context); t.ok()) {
          AddSlices(*s, *t);
        }
        break;
      }
      case 1: {
        const GrowRequest g{SequenceOf(*s), Rand(70)};
        Log(absl::StrCat("grow s", s->id.value(), " seq ", g.sequence.value(), " to ",
                         g.num_tokens));
        if (engine_->Grow(*s, std::span(&g, 1), *context).ok()) {
          Seq& seq = model_seqs_.at(g.sequence);
          seq.tokens = std::max(seq.tokens, g.num_tokens);
        }
        break;
      }
      case 2: {
        const SequenceId id = SequenceOf(*s);
        const int64_t n = Rand(40);
        Log(absl::StrCat("truncate s", s->id.value(), " seq ", id.value(), " to ", n));
        if (engine_->Truncate(*s, id, n, *context).ok()) model_seqs_.at(id).tokens = n;
        break;
      }
      case 3: {
        const SequenceId id = SequenceOf(*s);
        if (absl::StatusOr<Tables> t = engine_->Fork(*s, id, *context); t.ok()) AddSlices(*s, *t);
        break;
      }
      case 4: {
        const SequenceId id = SequenceOf(*s);
        const auto it = model_seqs_.find(id);
        const int64_t n =
            it == model_seqs_.end() ? 5 : Rand(static_cast<int>(it->second.tokens) + 2);
        engine_->Commit(*s, id, n, Tokens(static_cast<int>(n)), *context).IgnoreError();
        break;
      }
      case 5: {
        std::vector<SequenceId> ids = {SequenceOf(*s)};
        if (Chance(30)) ids.push_back(SequenceOf(*s));
        if (engine_->Free(*s, ids, Chance(50) ? OnFree::kCommit : OnFree::kDiscard, *context)
                .ok()) {
          for (SequenceId id : ids) model_seqs_.erase(id);
        }
        break;
      }
    }
  }

  std::unique_ptr<ComputeCall> ComputeCallOf(const std::shared_ptr<const Session>& s) {
    ComputeRequest r;
    if (Chance(50)) {
      r.kind = ComputeRequest::Kind::kPrefill;
      r.sequence = Chance(50) ? SequenceId(0) : SequenceOf(*s);
      r.tokens = Tokens(1 + Rand(24));
    } else {
      r.kind = ComputeRequest::Kind::kDecode;
      for (int k = 1 + Rand(2); k > 0; --k) r.decode.push_back({SequenceOf(*s), Rand(kVocab)});
    }
    std::shared_ptr<CallContext> context = Context();
    auto call =
        std::make_unique<ComputeCall>(s, std::move(r), std::move(context), [](ComputeCall&) {});
    return call;
  }

  // What a completed compute call did, in the model.
  void Account(ComputeCall& call) {
    const ComputeResult& r = call.result();
    if (!r.status.ok()) return;
    for (size_t i = 0; i < r.sequences.size(); ++i) {
      model_seqs_[r.sequences[i]] = {call.session().id, r.lengths[i]};
    }
  }

  // A prefill between chunks: the sequence it holds, and how to undo it.
  struct Pending {
    std::unique_ptr<ComputeCall> call;
    SequenceId sequence;
    int64_t start = 0;
    bool created = false;
  };

  // Whether a pending prefill's plan still holds: its sequence is as the plan left it (what
  // PrefillProgress::StillHolds asks, read from outside through the engine's listing).
  bool Holds(const Pending& p) {
    std::vector<SessionId> owners;
    std::vector<int32_t> pools;
    const Tables t = engine_->ListSequences(std::nullopt, p.call->session().id, &owners, &pools);
    const model::PlannedItem& item = p.call->progress()->item();
    size_t first = 0;
    for (const TableSlice& slice : t.slices) {
      if (slice.sequence == p.sequence) {
        if (slice.num_tokens != item.start + static_cast<int64_t>(item.tokens.size())) return false;
        if (static_cast<size_t>(slice.length) < item.table.size()) return false;
        for (size_t i = 0; i < item.table.size(); ++i) {
          if (t.blocks[first + i].value() != item.table[i]) return false;
        }
        return true;
      }
      first += static_cast<size_t>(slice.length);
    }
    return false;
  }

  // A pending prefill ended without an answer: it gave back what it held when its plan still held
  // (`held`); otherwise the client changed the sequence or its session ended, and nothing was
  // undone.
  void Resolve(const Pending& p, bool held) {
    if (!held) return;
    if (p.created) {
      model_seqs_.erase(p.sequence);
    } else if (auto it = model_seqs_.find(p.sequence); it != model_seqs_.end()) {
      it->second.tokens = p.start;
    }
  }

  void StepCall() {
    std::vector<Pending> before = std::move(pending_);  // prefills between chunks go first
    pending_.clear();
    std::vector<ComputeCall*> raw;
    std::vector<bool> held;
    for (Pending& p : before) {
      raw.push_back(p.call.get());
      held.push_back(Holds(p));
    }
    std::vector<std::unique_ptr<ComputeCall>> fresh;
    for (int k = 1 + Rand(3); k > 0; --k) {
      fresh.push_back(ComputeCallOf(AnySession()));
      raw.push_back(fresh.back().get());
    }
    for (ComputeCall* c : raw) c->chunk = 1 + Rand(16);
    StepExecutorOf(*engine_).RunStep(/*pool=*/0, raw);
    for (ComputeCall* c : raw) {
      const ComputeRequest& r = c->request();
      std::string line = absl::StrCat(
          "step s", c->session().id.value(), r.prefill() ? " prefill seq " : " decode seq ",
          r.prefill() ? r.sequence.value() : r.decode[0].sequence.value(),
          " n=", r.prefill() ? r.tokens.size() : r.decode.size(), " chunk=", c->chunk, " -> ",
          c->result().status.ToString(), c->unfinished() ? " unfinished" : "");
      if (c->progress())
        absl::StrAppend(&line, " item seq ", c->progress()->item().sequence.value(), " start ",
                        c->progress()->item().start, " computed ", c->progress()->computed());
      for (size_t i = 0; i < c->result().sequences.size(); ++i)
        absl::StrAppend(&line, " [", c->result().sequences[i].value(), ":", c->result().lengths[i],
                        "]");
      Log(line);
    }
    for (size_t i = 0; i < before.size(); ++i) {
      Pending& p = before[i];
      if (p.call->unfinished()) {
        pending_.push_back(std::move(p));
      } else if (p.call->result().status.ok()) {
        Account(*p.call);
      } else {
        Resolve(p, held[i]);
      }
    }
    for (std::unique_ptr<ComputeCall>& c : fresh) {
      if (!c->unfinished()) {
        Account(*c);  // an error left nothing behind
        continue;
      }
      const model::PlannedItem& item = c->progress()->item();
      const int64_t end = item.start + static_cast<int64_t>(item.tokens.size());
      model_seqs_[item.sequence] = {c->session().id, end};
      pending_.push_back({std::move(c), item.sequence, item.start, item.created});
    }
    // Now and then a prefill between chunks is abandoned (shutdown, the runner's cancellation).
    if (!pending_.empty() && Chance(10)) {
      const bool holds = Holds(pending_.back());
      StepExecutorOf(*engine_).Abandon(*pending_.back().call, absl::CancelledError("abandoned"));
      Resolve(pending_.back(), holds);
      pending_.pop_back();
    }
  }

  // The engine's sequences are exactly the model's.
  void ExpectModel(int op) {
    const absl::Status inv = engine_->CheckInvariants();
    ASSERT_TRUE(inv.ok()) << "op " << op << ": " << inv;
    std::vector<SessionId> owners;
    std::vector<int32_t> pools;
    const Tables t = engine_->ListSequences(std::nullopt, kNoSession, &owners, &pools);
    std::map<SequenceId, Seq> seen;
    for (size_t i = 0; i < t.slices.size(); ++i) {
      seen[t.slices[i].sequence] = {owners[i], t.slices[i].num_tokens};
    }
    ASSERT_EQ(seen.size(), model_seqs_.size()) << "op " << op << Recent();
    for (const auto& [id, seq] : model_seqs_) {
      auto it = seen.find(id);
      ASSERT_NE(it, seen.end()) << "op " << op << ": sequence " << id.value() << " is gone"
                                << Recent();
      ASSERT_EQ(it->second.owner, seq.owner) << "op " << op << Recent();
      ASSERT_EQ(it->second.tokens, seq.tokens)
          << "op " << op << " sequence " << id.value() << Recent();
    }
  }

  std::mt19937 rng_{20261201};
  kernels::CpuDevice device_{1};
  std::unique_ptr<model::Model> model_;
  std::unique_ptr<Engine> engine_;
  std::vector<std::shared_ptr<const Session>> live_, ended_;
  std::map<SequenceId, Seq> model_seqs_;
  std::vector<Pending> pending_;
  std::vector<std::string> log_;  // the last operations, printed on a failure
  void Log(std::string line) {
    if (log_.size() >= 12) log_.erase(log_.begin());
    log_.push_back(std::move(line));
  }
  std::string Recent() const {
    std::string out;
    for (const std::string& l : log_) out += "\n  " + l;
    return out;
  }
};

TEST_F(EngineRandomTest, SessionsCallsStepsCancellationsAndEndsNeverLeakOrCorrupt) {
  const int operations = Operations();
  for (int op = 0; op < operations; ++op) {
    const int what = Rand(100);
    if (what < 3) {
      EndSession();
    } else if (what < 5) {
      ASSERT_TRUE(engine_->Evict(0, 1 + Rand(16), /*all=*/false).ok());  // an operator's Evict
    } else if (what < 45) {
      StepCall();
    } else {
      ControlCall();
    }
    ExpectModel(op);
    if (HasFatalFailure()) return;
  }
  for (Pending& p : pending_)
    StepExecutorOf(*engine_).Abandon(*p.call, absl::UnavailableError("the end"));
  pending_.clear();
  while (!live_.empty()) EndSession();
  ExpectModel(operations);
  const EngineStats s = engine_->Stats();
  EXPECT_EQ(s.cache.sequences, 0);
  EXPECT_EQ(s.cache.pool.free + s.cache.pool.cached + s.cache.pool.retiring,
            s.cache.pool.num_blocks);
  // Each kind of outcome happened (the test exercised what it claims to).
  EXPECT_GT(s.model.steps, 1000u);
  EXPECT_GT(s.model.prefill_chunks, 100u);
  EXPECT_GT(s.calls.gave_up, 100u);
  EXPECT_GT(s.calls.released_on_give_up, 10u);
  EXPECT_GT(s.calls.session_ended, 10u);
  EXPECT_GT(s.sessions.lost, 10u);
  EXPECT_GT(s.cache.evictions, 10u);
  EXPECT_GT(s.cache.cow_copies, 10u);
  EXPECT_GT(s.tiers.promoted_from_host, 10u);
  EXPECT_GT(s.tiers.promote_adopted, 10u);
}

}  // namespace
}  // namespace kvpool::daemon

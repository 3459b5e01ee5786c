// Sampling through the engine's steps (issue 30): each call's parameters apply to its own
// sequences only, whatever else shares the step; a seed fixes the tokens; penalties count the
// whole sequence (prompt across its chunks, and what was generated); bad parameters fail the
// call at submission with INVALID_ARGUMENT and change nothing.

#include <cmath>
#include <map>

#include "absl/synchronization/notification.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/internal/step_executor_of.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using testing::FailingDevice;
using ::testing::HasSubstr;
using testing::HookModel;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

// One call's tokens and log-probabilities over a prefill and `decodes` decode steps.
struct Trace {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  bool operator==(const Trace&) const = default;
  friend void PrintTo(const Trace& t, std::ostream* os) {
    *os << "tokens " << ::testing::PrintToString(t.tokens) << " logprobs "
        << ::testing::PrintToString(t.logprobs);
  }
};

// A call as a test writes it: whose (0 alice, 1 bob, 2 carol: another tenant), its prompt, how
// it samples.
struct Plan {
  int who = 0;
  std::vector<int32_t> prompt;
  std::vector<model::SamplingParams> sampling;
};

class SamplingStepTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(); }
  void Make() {
    engine_.reset();
    EngineOptions options = SmallPool(96);
    model_ = std::make_unique<HookModel>(testing::TinyModel(options.pools[0].layout));
    engine_ = std::move(*Engine::Create(options, &device_, model_.get()));
    alice_ = *engine_->OpenSession(Spec("t", "alice"));
    bob_ = *engine_->OpenSession(Spec("t", "bob"));
    carol_ = *engine_->OpenSession(Spec("other-tenant", "carol"));
  }
  int32_t vocab() const { return engine_->model_info().vocab_size; }
  std::shared_ptr<const Session> session(int who) const {
    return who == 0 ? alice_ : who == 1 ? bob_ : carol_;
  }

  static std::unique_ptr<ComputeCall> Call(std::shared_ptr<const Session> s, ComputeRequest r) {
    return std::make_unique<ComputeCall>(std::move(s), std::move(r), nullptr, [](ComputeCall&) {});
  }
  void Run(std::vector<ComputeCall*> calls) { StepExecutorOf(*engine_).RunStep(/*pool=*/0, calls); }

  // Runs `plans` side by side: their prefills in one step, then each decode step together.
  std::vector<Trace> RunTogether(const std::vector<Plan>& plans, int decodes) {
    std::vector<Trace> traces(plans.size());
    std::vector<SequenceId> seqs(plans.size());
    std::vector<std::unique_ptr<ComputeCall>> calls;
    for (const Plan& p : plans) {
      calls.push_back(Call(session(p.who), {.kind = ComputeRequest::Kind::kPrefill,
                                            .tokens = p.prompt,
                                            .sampling = p.sampling,
                                            .logprobs = true}));
    }
    for (int step = 0; step <= decodes; ++step) {
      std::vector<ComputeCall*> raw;
      for (auto& c : calls) raw.push_back(c.get());
      Run(raw);
      for (size_t i = 0; i < plans.size(); ++i) {
        const ComputeResult& r = calls[i]->result();
        EXPECT_TRUE(r.status.ok()) << r.status;
        if (!r.status.ok()) return traces;
        seqs[i] = r.sequences[0];
        traces[i].tokens.push_back(r.results[0].next_token);
        traces[i].logprobs.push_back(r.results[0].logprob);
      }
      for (size_t i = 0; i < plans.size(); ++i) {
        calls[i] = Call(session(plans[i].who), {.kind = ComputeRequest::Kind::kDecode,
                                                .decode = {{seqs[i], traces[i].tokens.back()}},
                                                .sampling = plans[i].sampling,
                                                .logprobs = true});
      }
    }
    return traces;
  }

  // The full next-token distribution (top_k = vocab) after alice's greedy prefill of `prompt` in
  // a fresh engine, in chunks of `chunk`, then (when `pending` >= 0) a decode of `pending`: the
  // logits a sampled call on the same path sees, bit for bit.
  std::vector<model::TokenLogProb> Distribution(const std::vector<int32_t>& prompt, int64_t chunk,
                                                int32_t pending = -1) {
    Make();
    auto call = Call(alice_, {.kind = ComputeRequest::Kind::kPrefill,
                              .tokens = prompt,
                              .top_k = pending < 0 ? vocab() : 0});
    RunChunked(call.get(), chunk);
    EXPECT_TRUE(call->result().status.ok()) << call->result().status;
    if (pending < 0) return call->result().results[0].top;
    auto decode = Call(alice_, {.kind = ComputeRequest::Kind::kDecode,
                                .decode = {{call->result().sequences[0], pending}},
                                .top_k = vocab()});
    Run({decode.get()});
    EXPECT_TRUE(decode->result().status.ok()) << decode->result().status;
    return decode->result().results[0].top;
  }
  void RunChunked(ComputeCall* call, int64_t chunk) {
    int steps = 0;
    do {
      call->chunk = chunk;
      Run({call});
    } while (call->unfinished() && ++steps < 100);
  }

  // The argmax of `dist` under the penalties of `p` for the tokens of `history`.
  static int32_t PenalizedArgmax(const std::vector<model::TokenLogProb>& dist,
                                 const std::vector<int32_t>& history,
                                 const model::SamplingParams& p) {
    std::map<int32_t, int> counts;
    for (int32_t t : history) ++counts[t];
    int32_t best = -1;
    double best_value = -INFINITY;
    for (const model::TokenLogProb& t : dist) {
      const auto seen = counts.find(t.token);
      const int n = seen == counts.end() ? 0 : seen->second;
      const double v = t.logprob - p.frequency_penalty * n - (n > 0 ? p.presence_penalty : 0);
      if (v > best_value || (v == best_value && t.token < best)) {
        best = t.token;
        best_value = v;
      }
    }
    return best;
  }

  FailingDevice device_;
  std::unique_ptr<HookModel> model_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> alice_, bob_, carol_;
};

constexpr model::SamplingParams kHot{.temperature = 1.5F, .seed = 7};

TEST_F(SamplingStepTest, CallsInOneStepGetWhatTheyGetAlone) {
  const std::vector<Plan> plans = {
      {0, Prompt(24, 1), {{.temperature = 0.9F, .top_p = 0.8F, .seed = 11}}},
      {1, Prompt(40, 2), {{.temperature = 1.5F, .top_k = 20, .frequency_penalty = 1, .seed = 3}}},
      {2, Prompt(17, 3), {}},  // greedy
  };
  std::vector<Trace> alone;
  for (const Plan& p : plans) {
    Make();
    alone.push_back(RunTogether({p}, 6)[0]);
  }
  Make();
  const std::vector<Trace> together = RunTogether(plans, 6);
  for (size_t i = 0; i < plans.size(); ++i) EXPECT_EQ(together[i], alone[i]) << "call " << i;
  // The test can tell parameters apart: bob's sampled tokens are not his greedy ones.
  Make();
  Plan greedy_bob = plans[1];
  greedy_bob.sampling.clear();
  EXPECT_NE(RunTogether({greedy_bob}, 6)[0].tokens, together[1].tokens);
}

TEST_F(SamplingStepTest, TheSameSeedGivesTheSameTokensAndAnotherSeedOthers) {
  const std::vector<int32_t> prompt = Prompt(30, 4);
  const Trace first = RunTogether({{0, prompt, {kHot}}}, 7)[0];
  Make();
  EXPECT_EQ(RunTogether({{1, prompt, {kHot}}}, 7)[0], first);
  int differing = 0;
  for (uint64_t seed = 100; seed < 104; ++seed) {
    model::SamplingParams other = kHot;
    other.seed = seed;
    differing += RunTogether({{0, prompt, {other}}}, 7)[0].tokens != first.tokens;
  }
  EXPECT_GE(differing, 3);
}

TEST_F(SamplingStepTest, TemperatureZeroIsGreedyAndLogProbsAreTheModels) {
  const std::vector<int32_t> prompt = Prompt(33, 5);
  const Trace greedy = RunTogether({{0, prompt, {}}}, 5)[0];
  Make();  // the same path: no prefix of the first in the cache
  const Trace zero = RunTogether({{1, prompt, {{.temperature = 0, .seed = 9}}}}, 5)[0];
  EXPECT_EQ(zero, greedy);
  for (float lp : greedy.logprobs) {
    EXPECT_LE(lp, 0);
    EXPECT_TRUE(std::isfinite(lp));
  }
}

// Penalties count every prompt token, across chunks: the history is the sequence's, not the
// last chunk's.
TEST_F(SamplingStepTest, PenaltiesCountTheWholeChunkedPrompt) {
  constexpr int64_t kChunk = 32;
  // Negative penalties favour what the prompt holds: the answer is then one of its tokens. A
  // prompt where which one depends on the earlier chunks (counting only the last chunk's tokens
  // would choose another):
  const model::SamplingParams p{.presence_penalty = -2.0F, .frequency_penalty = -1.0F};
  std::vector<int32_t> prompt;
  int32_t want = -1;
  for (uint32_t seed = 6; seed < 16 && want < 0; ++seed) {
    prompt = Prompt(90, seed);
    const std::vector<model::TokenLogProb> dist = Distribution(prompt, kChunk);
    const std::vector<int32_t> last_chunk(prompt.begin() + 64, prompt.end());
    const int32_t whole = PenalizedArgmax(dist, prompt, p);
    if (whole != PenalizedArgmax(dist, last_chunk, p) &&
        whole != PenalizedArgmax(dist, prompt, {})) {
      want = whole;
    }
  }
  ASSERT_GE(want, 0);

  Make();
  auto call =
      Call(alice_, {.kind = ComputeRequest::Kind::kPrefill, .tokens = prompt, .sampling = {p}});
  RunChunked(call.get(), kChunk);
  ASSERT_TRUE(call->result().status.ok()) << call->result().status;
  EXPECT_EQ(call->result().results[0].next_token, want);
  // The decode after it counts the prompt and its pending token.
  const int32_t pending = call->result().results[0].next_token;
  auto decode = Call(alice_, {.kind = ComputeRequest::Kind::kDecode,
                              .decode = {{call->result().sequences[0], pending}},
                              .sampling = {p}});
  Run({decode.get()});
  ASSERT_TRUE(decode->result().status.ok()) << decode->result().status;
  std::vector<int32_t> longer = prompt;
  longer.push_back(pending);
  EXPECT_EQ(decode->result().results[0].next_token,
            PenalizedArgmax(Distribution(prompt, kChunk, pending), longer, p));
}

TEST_F(SamplingStepTest, BadParametersFailTheCallAtSubmission) {
  auto status_of = [&](ComputeRequest r) {
    absl::Notification done;
    absl::Status status;
    engine_->Submit(
        std::make_unique<ComputeCall>(alice_, std::move(r), nullptr, [&](ComputeCall& c) {
          status = c.result().status;
          done.Notify();
        }));
    done.WaitForNotification();
    return status;
  };
  const EngineStats before = engine_->Stats();
  const absl::Status hot = status_of({.kind = ComputeRequest::Kind::kPrefill,
                                      .tokens = Prompt(8, 1),
                                      .sampling = {{.temperature = 2.5F}}});
  EXPECT_EQ(hot.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(hot.message(), HasSubstr("temperature"));
  const absl::Status nan = status_of({.kind = ComputeRequest::Kind::kPrefill,
                                      .tokens = Prompt(8, 1),
                                      .sampling = {{.top_p = NAN}}});
  EXPECT_THAT(nan.message(), HasSubstr("top_p"));
  const absl::Status two = status_of(
      {.kind = ComputeRequest::Kind::kPrefill, .tokens = Prompt(8, 1), .sampling = {{}, {}}});
  EXPECT_EQ(two.code(), absl::StatusCode::kInvalidArgument);
  const absl::Status wide = status_of({.kind = ComputeRequest::Kind::kPrefill,
                                       .tokens = Prompt(8, 1),
                                       .sampling = {{.top_k = vocab() + 1}}});
  EXPECT_EQ(wide.code(), absl::StatusCode::kInvalidArgument);
  // A decode: none, one, or one per sequence; the message names the sequence.
  ComputeRequest decode{.kind = ComputeRequest::Kind::kDecode,
                        .decode = {{SequenceId(5), 1}, {SequenceId(6), 2}, {SequenceId(7), 3}},
                        .sampling = {{}, {}}};
  EXPECT_EQ(CheckSamplingOf(decode, vocab()).code(), absl::StatusCode::kInvalidArgument);
  decode.sampling = {{}, {.frequency_penalty = 3}, {}};
  EXPECT_THAT(CheckSamplingOf(decode, vocab()).message(), HasSubstr("sequence 6 (index 1)"));
  decode.sampling = {{.temperature = 1}};
  EXPECT_TRUE(CheckSamplingOf(decode, vocab()).ok());
  // Nothing ran, nothing is held.
  const EngineStats after = engine_->Stats();
  EXPECT_EQ(after.model.steps, before.model.steps);
  EXPECT_EQ(after.cache.pool.active, before.cache.pool.active);
}

}  // namespace
}  // namespace kvpool::daemon

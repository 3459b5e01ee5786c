// Generation (issue 29): Generate's prefill-then-decode loop as an engine object, driven through
// an engine alone (a ManualClock, no gRPC): what it yields equals the Prefill and Decode calls it
// stands for; it stops after max_tokens or a stop token, when the caller goes away or cancels, or
// at a step's error; it frees the sequence it created when the caller never learned of it, and
// with free_when_done.

#include "daemon/engine/generation.h"

#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "daemon/engine/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/daemon/engine_test_util.h"

namespace kvpool::daemon {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using testing::Prompt;
using testing::SmallPool;
using testing::Spec;

// What the caller does with each token: hand it on (the write succeeded), fail to, or cancel
// first.
enum class Reply { kDeliver, kLose, kCancelThenDeliver };

// Records what a generation yields; its behaviour per token is `on_token(index)`.
class RecordingSink final : public Generation::Sink {
 public:
  std::function<Reply(int32_t)> on_token = [](int32_t) { return Reply::kDeliver; };
  Generation* generation = nullptr;

  void OnToken(const GeneratedToken& token) override {
    {
      absl::MutexLock lock(&mu_);
      tokens_.push_back(token);
    }
    switch (on_token(token.index)) {
      case Reply::kDeliver:
        return generation->Delivered(true);
      case Reply::kLose:
        return generation->Delivered(false);
      case Reply::kCancelThenDeliver:
        generation->Cancel();
        return generation->Delivered(true);
    }
  }
  void OnEnd(const absl::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      ++ends_;
      status_ = status;
    }
    ended_.Notify();
  }

  // Waits for the end; the stream's status.
  absl::Status Wait() {
    ended_.WaitForNotification();
    absl::MutexLock lock(&mu_);
    return status_;
  }
  std::vector<GeneratedToken> tokens() const {
    absl::MutexLock lock(&mu_);
    return tokens_;
  }
  std::vector<int32_t> values() const {
    std::vector<int32_t> out;
    for (const GeneratedToken& t : tokens()) out.push_back(t.token);
    return out;
  }
  int ends() const {
    absl::MutexLock lock(&mu_);
    return ends_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<GeneratedToken> tokens_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  int ends_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Notification ended_;
};

class GenerationTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(); }
  void TearDown() override { engine_.reset(); }  // joins the runner before the sinks go

  void Make() {
    engine_.reset();
    EngineOptions options = SmallPool(96, &clock_);
    model_ = testing::TinyModel(options.pools[0].layout);
    engine_ = std::move(*Engine::Create(options, &device_, model_.get()));
    session_ = *engine_->OpenSession(Spec("t", "alice"));
  }

  // Runs one compute call to its end.
  ComputeResult Run(ComputeRequest request) {
    absl::Notification done;
    ComputeResult result;
    engine_->Submit(std::make_unique<ComputeCall>(session_, std::move(request), nullptr,
                                                  [&](ComputeCall& call) {
                                                    result = call.result();
                                                    done.Notify();
                                                  }));
    done.WaitForNotification();
    return result;
  }

  // The tokens and log-probabilities of a Prefill of `prompt` and `n - 1` Decodes, in a fresh
  // engine: what a generation of `n` tokens must yield.
  std::vector<model::ItemResult> Reference(const std::vector<int32_t>& prompt, int n,
                                           int32_t top_k) {
    Make();
    std::vector<model::ItemResult> out;
    ComputeResult r = Run({.kind = ComputeRequest::Kind::kPrefill,
                           .tokens = prompt,
                           .top_k = top_k,
                           .logprobs = true});
    EXPECT_TRUE(r.status.ok()) << r.status;
    const SequenceId seq = r.sequences[0];
    out.push_back(r.results[0]);
    while (static_cast<int>(out.size()) < n) {
      r = Run({.kind = ComputeRequest::Kind::kDecode,
               .decode = {{seq, out.back().next_token}},
               .top_k = top_k,
               .logprobs = true});
      EXPECT_TRUE(r.status.ok()) << r.status;
      out.push_back(r.results[0]);
    }
    Make();
    return out;
  }

  // Starts a generation whose tokens go to a new sink; both live until the fixture ends.
  RecordingSink* Generate(GenerationRequest request, std::function<Reply(int32_t)> on_token = {},
                          std::shared_ptr<const CallContext> context = nullptr) {
    auto sink = std::make_unique<RecordingSink>();
    if (on_token) sink->on_token = std::move(on_token);
    auto generation = std::make_unique<Generation>(engine_.get(), session_, std::move(request),
                                                   std::move(context), sink.get());
    sink->generation = generation.get();
    RecordingSink* out = sink.get();
    sinks_.push_back(std::move(sink));
    generations_.push_back(std::move(generation));
    generations_.back()->Start();
    return out;
  }

  int64_t Sequences() const { return engine_->Stats().cache.sequences; }

  ManualClock clock_{1'000'000'000};
  testing::FailingDevice device_;
  std::unique_ptr<model::Model> model_;
  std::vector<std::unique_ptr<RecordingSink>> sinks_;
  std::vector<std::unique_ptr<Generation>> generations_;
  std::unique_ptr<Engine> engine_;
  std::shared_ptr<const Session> session_;
};

TEST_F(GenerationTest, YieldsWhatPrefillAndDecodeReturn) {
  const std::vector<int32_t> prompt = Prompt(40, 1);
  const std::vector<model::ItemResult> want = Reference(prompt, 6, 3);
  RecordingSink* sink = Generate({.prompt = prompt, .top_k = 3, .logprobs = true, .max_tokens = 6});
  ASSERT_TRUE(sink->Wait().ok()) << sink->Wait();
  const std::vector<GeneratedToken> got = sink->tokens();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i].index, static_cast<int32_t>(i));
    EXPECT_EQ(got[i].token, want[i].next_token);
    EXPECT_EQ(got[i].logprob, want[i].logprob);
    ASSERT_EQ(got[i].top.size(), 3U);
    for (size_t k = 0; k < 3; ++k) EXPECT_EQ(got[i].top[k].token, want[i].top[k].token);
    EXPECT_EQ(got[i].sequence, got[0].sequence);
    // Only the prefill's token says how much of the prompt was reused.
    EXPECT_EQ(got[i].reused_tokens.has_value(), i == 0);
  }
  EXPECT_EQ(sink->ends(), 1);
  EXPECT_EQ(Sequences(), 1);  // the caller has it now
}

TEST_F(GenerationTest, StopsAfterTheFirstStopToken) {
  const std::vector<int32_t> prompt = Prompt(24, 2);
  const std::vector<model::ItemResult> want = Reference(prompt, 8, 0);
  // The last token of the reference that appears nowhere before it.
  size_t stop_at = want.size() - 1;
  while (stop_at > 0 && std::any_of(want.begin(), want.begin() + static_cast<ptrdiff_t>(stop_at),
                                    [&](const model::ItemResult& r) {
                                      return r.next_token == want[stop_at].next_token;
                                    })) {
    --stop_at;
  }
  std::vector<int32_t> expected;
  for (size_t i = 0; i <= stop_at; ++i) expected.push_back(want[i].next_token);
  RecordingSink* sink = Generate(
      {.prompt = prompt, .max_tokens = 100, .stop_tokens = {-5, want[stop_at].next_token}});
  EXPECT_TRUE(sink->Wait().ok()) << sink->Wait();
  EXPECT_THAT(sink->values(), ElementsAreArray(expected));
}

TEST_F(GenerationTest, StopsAfterMaxTokens) {
  RecordingSink* sink = Generate({.prompt = Prompt(20, 3), .max_tokens = 3});
  EXPECT_TRUE(sink->Wait().ok());
  EXPECT_EQ(sink->tokens().size(), 3U);
}

TEST_F(GenerationTest, ACallerWhoNeverReceivedATokenLeavesNoSequence) {
  RecordingSink* sink =
      Generate({.prompt = Prompt(40, 4), .max_tokens = 5}, [](int32_t) { return Reply::kLose; });
  const absl::Status s = sink->Wait();
  EXPECT_TRUE(absl::IsCancelled(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("client went away"));
  EXPECT_EQ(sink->tokens().size(), 1U);
  EXPECT_EQ(Sequences(), 0);  // the caller never learned its id: freed
}

TEST_F(GenerationTest, CancellingEndsAtTheNextTokenAndKeepsADeliveredSequence) {
  RecordingSink* sink = Generate({.prompt = Prompt(40, 5), .max_tokens = 50}, [](int32_t index) {
    return index == 2 ? Reply::kCancelThenDeliver : Reply::kDeliver;
  });
  EXPECT_TRUE(absl::IsCancelled(sink->Wait()));
  EXPECT_EQ(sink->tokens().size(), 3U);
  EXPECT_EQ(Sequences(), 1);  // the caller holds it (no free_when_done)
}

TEST_F(GenerationTest, FreeWhenDoneCommitsWhatWasGenerated) {
  const std::vector<int32_t> prompt = Prompt(40, 6);
  RecordingSink* sink = Generate({.prompt = prompt, .max_tokens = 4, .free_when_done = true});
  ASSERT_TRUE(sink->Wait().ok());
  EXPECT_EQ(Sequences(), 0);
  // Committed, not discarded: the whole prompt is in the prefix cache, its partial last block too.
  EXPECT_EQ(*engine_->MatchPrefix(*session_, prompt), 40);
}

TEST_F(GenerationTest, FreeWhenDoneDiscardsACancelledStream) {
  const std::vector<int32_t> prompt = Prompt(40, 7);
  RecordingSink* sink = Generate(
      {.prompt = prompt, .max_tokens = 10, .free_when_done = true},
      [](int32_t index) { return index == 1 ? Reply::kCancelThenDeliver : Reply::kDeliver; });
  EXPECT_TRUE(absl::IsCancelled(sink->Wait()));
  EXPECT_EQ(Sequences(), 0);
  // Discarded: only the full blocks the prefill itself cached remain, not the partial tail.
  EXPECT_EQ(*engine_->MatchPrefix(*session_, prompt), 32);
}

// A stream whose session ends is one call refused for it; the free the stream does for its
// caller afterwards is the daemon's own, not a second call of the client's.
TEST_F(GenerationTest, AStreamWhoseSessionEndedCountsOneRefusedCall) {
  RecordingSink* sink = Generate(
      {.prompt = Prompt(40, 12), .max_tokens = 50, .free_when_done = true}, [&](int32_t index) {
        if (index == 1) engine_->EndSession(session_->id, SessionEnd::kConnectionLost);
        return Reply::kDeliver;
      });
  EXPECT_FALSE(sink->Wait().ok());
  EXPECT_EQ(sink->ends(), 1);
  EXPECT_EQ(Sequences(), 0);  // the session's end released it
  EXPECT_EQ(engine_->Stats().calls.session_ended, 1U);
}

TEST_F(GenerationTest, MaxTokensBelowOneIsRefusedBeforeAnyStep) {
  RecordingSink* sink = Generate({.prompt = Prompt(20, 8), .max_tokens = 0});
  const absl::Status s = sink->Wait();
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  EXPECT_THAT(s.message(), HasSubstr("max_tokens 0"));
  EXPECT_TRUE(sink->tokens().empty());
  EXPECT_EQ(Sequences(), 0);
}

TEST_F(GenerationTest, AStepsErrorEndsTheStream) {
  RecordingSink* sink =
      Generate({.sequence = SequenceId(12345), .prompt = Prompt(4, 9), .max_tokens = 5});
  const absl::Status s = sink->Wait();
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  EXPECT_TRUE(sink->tokens().empty());
  EXPECT_EQ(sink->ends(), 1);
}

TEST_F(GenerationTest, AStoppedEngineEndsTheStreamUnavailable) {
  engine_->StopCompute();
  RecordingSink* sink = Generate({.prompt = Prompt(20, 10), .max_tokens = 5});
  EXPECT_TRUE(absl::IsUnavailable(sink->Wait())) << sink->Wait();
  EXPECT_EQ(Sequences(), 0);
}

TEST_F(GenerationTest, ACallerWhoGaveUpBeforeTheNextStepEndsTheStream) {
  auto context = std::make_shared<ManualCallContext>(&clock_);
  RecordingSink* sink = Generate(
      {.prompt = Prompt(40, 11), .max_tokens = 50},
      [&](int32_t index) {
        if (index == 1) context->Cancel();  // gone before the next decode runs
        return Reply::kDeliver;
      },
      context);
  EXPECT_TRUE(absl::IsCancelled(sink->Wait())) << sink->Wait();
  EXPECT_EQ(sink->tokens().size(), 2U);
  EXPECT_EQ(sink->ends(), 1);
}

}  // namespace
}  // namespace kvpool::daemon

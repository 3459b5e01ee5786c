// The daemon's model over real sockets: Prefill, Decode and Generate from real sessions, checked
// against the same model run in this process (label `integration`).

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/client.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "model/local_engine.h"
#include "tests/integration/harness.h"

namespace kvpool::testing {
namespace {

using ::testing::HasSubstr;

// The embedded default model (tiny, seed 1) over a 32 MiB pool.
constexpr char kConfig[] = R"pb(
  pool_bytes: 33554432 max_blocks_per_seq: 256
)pb";

std::unique_ptr<client::Client> Connect(const std::string& dir, const std::string& name,
                                        absl::Duration timeout = absl::Seconds(10)) {
  absl::StatusOr<std::unique_ptr<client::Client>> c =
      client::Client::Connect({.runtime_dir = dir, .client_name = name, .timeout = timeout});
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// Prefill `prompt` and decode until `n` tokens were generated, through the daemon.
struct Generated {
  std::vector<int32_t> tokens;
  uint64_t sequence = 0;
  int64_t reused = 0;
  int32_t max_step_sequences = 0;
};
Generated Converse(const client::Client& c, const std::vector<int32_t>& prompt, int n) {
  Generated g;
  absl::StatusOr<v1::PrefillResponse> first = c.Prefill(0, prompt);
  EXPECT_TRUE(first.ok()) << first.status();
  if (!first.ok()) return g;
  g.sequence = first->sequence_id();
  g.reused = first->reused_tokens();
  g.tokens.push_back(first->next_token());
  while (static_cast<int>(g.tokens.size()) < n) {
    const client::DecodeItem item{g.sequence, g.tokens.back()};
    absl::StatusOr<v1::DecodeResponse> next = c.Decode(std::span(&item, 1));
    EXPECT_TRUE(next.ok()) << next.status();
    if (!next.ok()) break;
    g.tokens.push_back(next->next_tokens(0));
    g.max_step_sequences = std::max(g.max_step_sequences, next->step_sequences());
  }
  return g;
}

// The same, in this process, with model `w`.
std::vector<int32_t> RunLocally(const model::ModelWeights& w, const std::vector<int32_t>& prompt,
                                int n, kernels::DType dtype) {
  // (Alone: nothing cached, every token computed; a sliding layer's K/V kept for every token, as
  // before window groups.)
  auto engine = model::LocalEngine::Create(w, {.block_size = 16,
                                               .dtype = dtype,
                                               .pool_bytes = 32 << 20,
                                               .prefix_cache = w.config.num_state_layers() == 0,
                                               .window_blocks = -1});
  EXPECT_TRUE(engine.ok()) << engine.status();
  std::vector<int32_t> out;
  auto first = (*engine)->Prefill(SequenceId(0), prompt);
  EXPECT_TRUE(first.ok()) << first.status();
  if (!first.ok()) return out;
  out.push_back(first->result.next_token);
  while (static_cast<int>(out.size()) < n) {
    const model::DecodeInput in{first->sequence, out.back()};
    auto next = (*engine)->Decode(std::span(&in, 1));
    EXPECT_TRUE(next.ok()) << next.status();
    out.push_back((*next)[0].next_token);
  }
  return out;
}

// The same with the named model (seed 1, as kvpoold makes it).
std::vector<int32_t> RunLocally(const std::vector<int32_t>& prompt, int n,
                                kernels::DType dtype = kernels::DType::kBF16,
                                const char* model_name = "tiny") {
  return RunLocally(model::SyntheticWeights(*model::NamedConfig(model_name), 1), prompt, n, dtype);
}

class ComputeIntegrationTest : public ::testing::Test {
 protected:
  void StartDaemon(const std::string& config = kConfig) {
    absl::StatusOr<std::unique_ptr<DaemonProcess>> d = DaemonProcess::Start(config);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
  }
  v1::GetStatsResponse Stats(const client::Client& c) {
    absl::StatusOr<v1::GetStatsResponse> s = c.GetStats();
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : v1::GetStatsResponse{};
  }
  void KillWhileDecoding(const std::string& mode);
  v1::PoolLayout ServeSavedCheckpoint(const model::ModelWeights& weights, int64_t pool_bytes,
                                      const std::string& name);
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(ComputeIntegrationTest, DaemonGeneratesWhatTheModelGeneratesInProcess) {
  StartDaemon();
  auto c = Connect(daemon_->dir(), "one");
  const std::vector<int32_t> prompt = Prompt(40, 1);
  const Generated g = Converse(*c, prompt, 8);
  EXPECT_EQ(g.reused, 0);
  EXPECT_EQ(g.tokens, RunLocally(prompt, 8));
  const v1::GetStatsResponse s = Stats(*c);
  EXPECT_EQ(s.model(), "tiny");
  EXPECT_EQ(s.prefill_calls(), 1u);
  EXPECT_EQ(s.prefill_tokens_computed(), 40u);
  EXPECT_EQ(s.decode_tokens(), 7u);
}

TEST_F(ComputeIntegrationTest, ConcurrentClientsGetTheTokensEachGetsAlone) {
  StartDaemon();
  constexpr int kClients = 4;
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<Generated> alone;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(Connect(daemon_->dir(), "client-" + std::to_string(i)));
    prompts.push_back(Prompt(20 + 7 * static_cast<size_t>(i), 100 + static_cast<uint32_t>(i)));
    alone.push_back(Converse(*clients.back(), prompts.back(), 12));
    ASSERT_TRUE(clients.back()->Free({alone.back().sequence}).ok());
  }
  std::vector<Generated> together(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      together[static_cast<size_t>(i)] =
          Converse(*clients[static_cast<size_t>(i)], prompts[static_cast<size_t>(i)], 12);
    });
  }
  for (std::thread& t : threads) t.join();
  int32_t widest = 0;
  for (int i = 0; i < kClients; ++i) {
    EXPECT_EQ(together[static_cast<size_t>(i)].tokens, alone[static_cast<size_t>(i)].tokens)
        << "client " << i;
    widest = std::max(widest, together[static_cast<size_t>(i)].max_step_sequences);
  }
  // The clients' decodes were gathered into shared steps.
  EXPECT_GT(widest, 1);
  auto admin = Connect(daemon_->dir(), "admin");
  EXPECT_TRUE(admin->CheckInvariants()->ok());
}

TEST_F(ComputeIntegrationTest, LongPromptIsPrefilledInChunksBesideAnotherClientsDecodes) {
  // f32 K/V: a decode that shares a step with a prefill chunk goes through sgemm, not the
  // skinny product, so its K/V differ in the last bits; bf16 storage can turn that into a
  // different greedy token many steps later. Exact equality is only meaningful in f32.
  StartDaemon(R"pb(
    pool_bytes: 33554432
    max_blocks_per_seq: 256
    shape { dtype: "f32" }
    model { max_step_tokens: 64 }
  )pb");
  auto a = Connect(daemon_->dir(), "long-prompt");
  auto b = Connect(daemon_->dir(), "decoder");
  const std::vector<int32_t> long_prompt = Prompt(400, 7), short_prompt = Prompt(10, 8);
  Generated decoded, prefilled;
  std::thread decoder([&] { decoded = Converse(*b, short_prompt, 24); });
  std::thread prefiller([&] { prefilled = Converse(*a, long_prompt, 4); });
  decoder.join();
  prefiller.join();
  // Both get what each gets alone, the long prompt in seven steps of at most 64 tokens.
  EXPECT_EQ(prefilled.tokens, RunLocally(long_prompt, 4, kernels::DType::kF32));
  EXPECT_EQ(decoded.tokens, RunLocally(short_prompt, 24, kernels::DType::kF32));
  const v1::GetStatsResponse s = Stats(*a);
  EXPECT_GE(s.prefill_chunks(), 6u);
  EXPECT_EQ(s.prefill_tokens_computed(), 410u);
  EXPECT_TRUE(a->CheckInvariants()->ok());
}

// Issue 10: a Prefill whose client gave up (its deadline passed while it waited behind a long
// prompt) still created a sequence the client never learned of, once its turn came.
TEST_F(ComputeIntegrationTest, APrefillWhoseDeadlinePassesInTheQueueLeavesNothing) {
  // The long prompt holds 38 steps of 16 tokens, and the waiting prompt is never let in
  // beside it (prefill_max_wait_steps): it waits there for longer than its deadline.
  StartDaemon(R"pb(
    pool_bytes: 33554432
    max_blocks_per_seq: 256
    model { max_step_tokens: 16 prefill_max_wait_steps: 1000 }
  )pb");
  // The long prompt's own calls must not give up: 38 steps take seconds under ASan on a busy
  // machine, past the default 10 s deadline.
  auto a = Connect(daemon_->dir(), "long-prompt", absl::Minutes(5));
  auto b = Connect(daemon_->dir(), "impatient");
  Generated long_one;
  std::thread prefiller([&] { long_one = Converse(*a, Prompt(600, 9), 1); });
  // Wait until the long prompt is under way (its chunks hold the steps).
  for (int i = 0; i < 2000 && Stats(*a).prefill_chunks() == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(1));
  }
  grpc::ClientContext context;
  b->PrepareContext(&context, /*deadline=*/false);
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(50));
  v1::PrefillRequest request;
  for (int32_t t : Prompt(40, 10)) request.add_tokens(t);
  v1::PrefillResponse response;
  EXPECT_EQ(b->stub().Prefill(&context, request, &response).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  prefiller.join();
  ASSERT_EQ(long_one.tokens.size(), 1u);
  const v1::GetStatsResponse s = Stats(*a);
  EXPECT_EQ(s.sequences(), 1u);  // the long prompt's; none for the caller who gave up
  EXPECT_GE(s.calls_given_up(), 1u);
  EXPECT_TRUE(a->CheckInvariants()->ok());
}

TEST_F(ComputeIntegrationTest, PrefillReusesAnotherSessionsConversation) {
  StartDaemon();
  const std::vector<int32_t> prompt = Prompt(45, 7);
  std::vector<int32_t> generated;
  {
    auto a = Connect(daemon_->dir(), "first");
    v1::GenerateRequest request;
    request.mutable_prompt()->Add(prompt.begin(), prompt.end());
    request.set_max_tokens(6);
    request.set_free_when_done(true);  // publishes the 45 + 5 tokens whose K/V it wrote
    ASSERT_TRUE(a->Generate(request, [&](const v1::GenerateResponse& r) {
                   generated.push_back(r.token());
                   return true;
                 }).ok());
    ASSERT_EQ(generated.size(), 6u);
  }
  // Another session continues the conversation: everything the first wrote is reused,
  // including the partial block it ended in (50 = 3 * 16 + 2).
  auto b = Connect(daemon_->dir(), "second");
  std::vector<int32_t> history = prompt;
  history.insert(history.end(), generated.begin(), generated.end() - 1);
  const std::vector<int32_t> follow_up = Prompt(9, 8);
  history.insert(history.end(), follow_up.begin(), follow_up.end());
  const Generated g = Converse(*b, history, 4);
  EXPECT_EQ(g.reused, 50);
  EXPECT_EQ(g.tokens, RunLocally(history, 4));
}

// A sliding-window model (issue 28's tiny-swa: window 256 in every other layer) served to
// several clients whose prompts share a prefix longer than the window: each reply, reused from
// another client's prefix or computed beside the others, equals the model run alone in this
// process.
TEST_F(ComputeIntegrationTest, ASlidingWindowModelSharesPrefixesAsComputedAlone) {
  StartDaemon(R"pb(
    pool_bytes: 33554432
    max_blocks_per_seq: 256
    shape { dtype: "f32" }
    model { name: "tiny-swa" }
  )pb");
  const std::vector<int32_t> shared = Prompt(300, 21);
  constexpr int kClients = 3;
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(Connect(daemon_->dir(), "swa-" + std::to_string(i)));
    std::vector<int32_t> p = shared;
    const std::vector<int32_t> own = Prompt(10 + static_cast<size_t>(i), 40 + i);
    p.insert(p.end(), own.begin(), own.end());
    prompts.push_back(std::move(p));
  }
  std::vector<Generated> first(kClients), again(kClients);
  for (int i = 0; i < kClients; ++i) {
    first[i] = Converse(*clients[i], prompts[i], 6);
    EXPECT_EQ(first[i].tokens, RunLocally(prompts[i], 6, kernels::DType::kF32, "tiny-swa"))
        << "client " << i;
    if (i > 0) {
      EXPECT_GE(first[i].reused, 288) << "client " << i;  // the shared 18 blocks
    }
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] { again[i] = Converse(*clients[i], prompts[i], 6); });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    EXPECT_EQ(again[i].tokens, first[i].tokens) << "client " << i;
    EXPECT_GE(again[i].reused, 288) << "client " << i;
  }
  EXPECT_EQ(Stats(*clients[0]).model(), "tiny-swa");
  EXPECT_TRUE(clients[0]->CheckInvariants()->ok());
}

// The same model with prefills in chunks of 64 tokens: a 600-token prompt crosses the window
// twice while it is computed, its window blocks go back to the pool between chunks, and two
// clients conversing at once past the window get what the model computes alone, keeping every
// token.
TEST_F(ComputeIntegrationTest, ASlidingWindowSlidesBetweenPrefillChunksAndDecodes) {
  StartDaemon(R"pb(
    pool_bytes: 33554432
    max_blocks_per_seq: 256
    shape { dtype: "f32" }
    model { name: "tiny-swa" max_step_tokens: 64 }
  )pb");
  constexpr int kClients = 2;
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<Generated> got(kClients);
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(Connect(daemon_->dir(), "slide-" + std::to_string(i)));
    prompts.push_back(Prompt(600 + 17 * static_cast<size_t>(i), 90 + static_cast<uint32_t>(i)));
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] { got[i] = Converse(*clients[i], prompts[i], 40); });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    EXPECT_EQ(got[i].tokens, RunLocally(prompts[i], 40, kernels::DType::kF32, "tiny-swa"))
        << "client " << i;
  }
  const v1::GetStatsResponse s = Stats(*clients[0]);
  EXPECT_GT(s.prefill_chunks(), 0u);
  EXPECT_TRUE(clients[0]->CheckInvariants()->ok());
}

// A prompt far longer than the window group could hold at once (1,200 tokens: 75 blocks, in a
// window group of 32) goes through in chunks, each taking only its own window blocks; the next
// client's prompt through it resumes where the window is still kept, and both equal the model
// alone.
TEST_F(ComputeIntegrationTest, APromptLongerThanTheWindowGroupGoesThroughInChunks) {
  StartDaemon(R"pb(
    pool_bytes: 67108864
    max_blocks_per_seq: 256
    shape { dtype: "f32" window_blocks: 32 }
    model { name: "tiny-swa" max_step_tokens: 64 }
  )pb");
  auto a = Connect(daemon_->dir(), "long-a");
  auto b = Connect(daemon_->dir(), "long-b");
  const std::vector<int32_t> prompt = Prompt(1200, 7);
  const Generated first = Converse(*a, prompt, 12);
  ASSERT_EQ(first.tokens.size(), 12u);
  EXPECT_EQ(first.tokens, RunLocally(prompt, 12, kernels::DType::kF32, "tiny-swa"));
  ASSERT_TRUE(a->Free({first.sequence}, /*commit=*/true).ok());
  std::vector<int32_t> more = prompt;
  more.insert(more.end(), first.tokens.begin(), first.tokens.end());
  const Generated second = Converse(*b, more, 12);
  EXPECT_EQ(second.tokens, RunLocally(more, 12, kernels::DType::kF32, "tiny-swa"));
  EXPECT_GE(second.reused, 1200);
  EXPECT_TRUE(a->CheckInvariants()->ok());
}

// Issue 28's tiny-hybrid (state-space, state-space, full attention, state-space) in a pool with
// room for 8 working states and as many checkpoints.
constexpr std::string_view kHybridDaemon = R"pb(
  pool_bytes: 33554432
  max_blocks_per_seq: 256
  shape { dtype: "f32" state_slots: 8 checkpoint_slots: 8 }
  model { name: "tiny-hybrid" }
)pb";

// Client i's prompt: 40 shared tokens, then 5 + i of its own.
std::vector<int32_t> HybridPrompt(int i) {
  std::vector<int32_t> p = Prompt(40, 61);
  const std::vector<int32_t> own = Prompt(5 + static_cast<size_t>(i), 70 + i);
  p.insert(p.end(), own.begin(), own.end());
  return p;
}

// A hybrid model served to several clients at once: each sequence's state lives in the pool's
// state group, prompts resume from the prefix cache's state checkpoints, and every reply equals
// the model run alone in this process.
TEST_F(ComputeIntegrationTest, AHybridModelKeepsEachSequencesStateInThePool) {
  StartDaemon(std::string(kHybridDaemon));
  constexpr int kClients = 3;
  std::vector<std::unique_ptr<client::Client>> clients;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<int32_t>> alone;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(Connect(daemon_->dir(), "hybrid-" + std::to_string(i)));
    prompts.push_back(HybridPrompt(i));
    alone.push_back(RunLocally(prompts[i], 6, kernels::DType::kF32, "tiny-hybrid"));
  }
  // One client after the other: the first computes everything, and its prefill (45 tokens)
  // leaves a checkpoint at its last block boundary, 32, inside the shared 40 tokens: the others
  // resume there. Each frees its sequence with commit (its state becomes a checkpoint too).
  for (int i = 0; i < kClients; ++i) {
    const Generated g = Converse(*clients[i], prompts[i], 6);
    EXPECT_EQ(g.tokens, alone[i]) << "client " << i;
    EXPECT_EQ(g.reused, i == 0 ? 0 : 32) << "client " << i;
    ASSERT_TRUE(clients[i]->Free({g.sequence}, /*commit=*/true).ok());
  }
  // Then all at once.
  std::vector<Generated> got(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] { got[i] = Converse(*clients[i], prompts[i], 6); });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    EXPECT_EQ(got[i].tokens, alone[i]) << "client " << i;
    EXPECT_EQ(got[i].reused, 32) << "client " << i;
  }

  const v1::GetStatsResponse stats = Stats(*clients[0]);
  EXPECT_EQ(stats.model(), "tiny-hybrid");
  auto stat = [&](const std::string& name, const std::string& label) {
    for (const v1::Stat& st : stats.stats()) {
      if (st.name() == name && !st.label_values().empty() &&
          st.label_values(st.label_values_size() - 1) == label) {
        return st.value();
      }
    }
    ADD_FAILURE() << "no stat " << name << "{" << label << "}";
    return -1.0;
  };
  // The second pass found 44 tokens of prompts[0] for full attention, resumed 32 of them.
  EXPECT_GE(stat("missed_tokens", "no_checkpoint"), 12);
  EXPECT_GE(stat("state_checkpoints", "kept"), 1 + kClients);  // 32, and each committed end
  EXPECT_EQ(stat("state_checkpoints", "resumed"), 2 * kClients - 1);
  // Every live sequence, the checkpoint they resumed from, held while they live, and the
  // rolling checkpoints of those whose decodes passed 48 (all three; a quarter of the 8
  // checkpoint slots can hold two, the third was skipped).
  EXPECT_EQ(stat("state_slots", "active"), kClients + 1 + 2);
  EXPECT_GE(stat("state_checkpoints", "skipped"), 1);
  EXPECT_TRUE(clients[0]->CheckInvariants()->ok());
}

// Saves `weights` as a checkpoint (in its model's own layout), serves it by kvpoold from its
// directory with a pool of `pool_bytes`, and has three clients converse in turn: each reply
// equals the checkpoint's model run alone in this process, and each client after the first
// resumes from the state checkpoint the first one's prefill left at 32. Returns the pool's
// layout as the clients see it.
v1::PoolLayout ComputeIntegrationTest::ServeSavedCheckpoint(const model::ModelWeights& weights,
                                                            int64_t pool_bytes,
                                                            const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name + "-" + std::to_string(getpid());
  EXPECT_TRUE(model::SaveCheckpoint(weights, dir, "f32").ok());
  StartDaemon(absl::StrCat(R"pb(
                             pool_bytes:)pb",
                           pool_bytes, R"pb(
                             max_blocks_per_seq: 256
                             shape { dtype: "f32" state_slots: 8 }
                             model { checkpoint: ")pb",
                           dir, R"pb(" }
  )pb"));
  v1::PoolLayout layout;
  for (int i = 0; i < 3 && !HasFatalFailure(); ++i) {
    auto c = Connect(daemon_->dir(), name + "-" + std::to_string(i));
    layout = c->layout();
    const std::vector<int32_t> prompt = HybridPrompt(i);
    const Generated g = Converse(*c, prompt, 6);
    EXPECT_EQ(g.tokens, RunLocally(weights, prompt, 6, kernels::DType::kF32)) << "client " << i;
    EXPECT_EQ(g.reused, i == 0 ? 0 : 32) << "client " << i;
    EXPECT_TRUE(c->Free({g.sequence}, /*commit=*/true).ok());
    EXPECT_TRUE(c->CheckInvariants()->ok());
  }
  std::filesystem::remove_all(dir);
  return layout;
}

// A Nemotron-H checkpoint (one mixer or MLP per layer, squared-ReLU MLP layers, attention
// without RoPE, 4 B/C groups) at tiny's width, saved in Nemotron-H's layout.
TEST_F(ComputeIntegrationTest, ANemotronHCheckpointIsServedAsItComputesAlone) {
  model::ModelConfig config = *model::NamedConfig("tiny-hybrid");
  const model::LayerKind kS = model::LayerKind::kStateSpace, kM = model::LayerKind::kMlp;
  config.num_layers = 6;
  config.layer_kinds = {kS, kM, kS, model::LayerKind::kFullAttention, kM, kS};
  config.ssm.num_groups = 4;
  config.mlp_after_mixer = false;
  config.mlp_activation = model::MlpActivation::kReluSquared;
  config.rope = false;
  ServeSavedCheckpoint(model::SyntheticWeights(config, 3), int64_t{32} << 20, "nemotron-h");
}

// A Falcon-H1 checkpoint (every layer attention and a Mamba-2 mixer side by side, no gated
// norm) at tiny's width, saved in Falcon-H1's layout: every layer keeps K/V in the pool and a
// state in the sequence's slot (four times tiny-hybrid's: twice its pool).
TEST_F(ComputeIntegrationTest, AFalconH1CheckpointIsServedAsItComputesAlone) {
  model::ModelConfig config = *model::NamedConfig("tiny-hybrid");
  config.layer_kinds.assign(4, model::LayerKind::kParallelHybrid);
  config.ssm.gated_norm = false;
  const v1::PoolLayout layout =
      ServeSavedCheckpoint(model::SyntheticWeights(config, 5), int64_t{64} << 20, "falcon-h1");
  EXPECT_EQ(layout.num_layers(), 4);  // every layer's K/V
  EXPECT_GT(layout.num_state_slots(), 0);
}

// kvpoold takes a hybrid pool's interval checkpoints at three times the break-even interval
// (docs/hybrid-groups.md §4): a prompt that leaves a cached one 70 tokens past its first interval
// checkpoint resumes exactly there (every 4 blocks, the core's default, or the break-even
// interval would resume elsewhere).
TEST_F(ComputeIntegrationTest, AHybridPoolTakesCheckpointsAtThriceTheBreakEvenInterval) {
  StartDaemon(std::string(kHybridDaemon));
  // A prefill of about 1,700 tokens: seconds under the sanitizers, past the default deadline.
  auto c = Connect(daemon_->dir(), "hybrid-interval", absl::Seconds(180));
  const v1::PoolLayout& layout = c->layout();
  const int64_t interval =
      3 * ((layout.state_slot_bytes() + layout.block_bytes() - 1) / layout.block_bytes()) *
      layout.block_size();  // in tokens
  ASSERT_GT(interval, 4 * layout.block_size());
  ASSERT_NE((interval + 70) / 64 * 64, interval);  // where 4-block checkpoints would resume
  const std::vector<int32_t> first = Prompt(static_cast<size_t>(interval + 100), 21);
  const Generated a = Converse(*c, first, 1);
  ASSERT_TRUE(c->Free({a.sequence}, /*commit=*/true).ok());
  std::vector<int32_t> second(first.begin(), first.begin() + interval + 70);
  for (int32_t t : Prompt(20, 22)) second.push_back(t);
  const Generated b = Converse(*c, second, 1);
  EXPECT_EQ(b.reused, interval);
  ASSERT_TRUE(c->Free({b.sequence}, /*commit=*/false).ok());
  EXPECT_TRUE(c->CheckInvariants()->ok());
}

// A fork of a hybrid sequence decodes from a copy of its parent's state, and rewinds only to a
// state checkpoint on its path.
TEST_F(ComputeIntegrationTest, AHybridForkCarriesItsStateAndRewindsToACheckpoint) {
  StartDaemon(std::string(kHybridDaemon));
  auto client = Connect(daemon_->dir(), "hybrid-fork");
  const client::Client& c = *client;
  const std::vector<int32_t> prompt = HybridPrompt(0);
  const std::vector<int32_t> alone = RunLocally(prompt, 2, kernels::DType::kF32, "tiny-hybrid");
  absl::StatusOr<v1::PrefillResponse> first = c.Prefill(0, prompt);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->next_token(), alone[0]);
  absl::StatusOr<v1::SequenceInfo> fork = c.Fork(first->sequence_id());
  ASSERT_TRUE(fork.ok()) << fork.status();
  ASSERT_TRUE(fork->has_state_slot());
  const client::DecodeItem both[] = {{first->sequence_id(), first->next_token()},
                                     {fork->sequence_id(), first->next_token()}};
  absl::StatusOr<v1::DecodeResponse> next = c.Decode(both);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->next_tokens(0), alone[1]);
  EXPECT_EQ(next->next_tokens(1), alone[1]);
  // The prefill (45 tokens) kept a checkpoint at its last block boundary, 32: the fork rewinds
  // there and computes the rest again, with the same answer. At 40 there is none: refused,
  // naming 32.
  const absl::Status no_checkpoint = c.Truncate(fork->sequence_id(), 40);
  EXPECT_EQ(no_checkpoint.code(), absl::StatusCode::kFailedPrecondition) << no_checkpoint;
  EXPECT_THAT(std::string(no_checkpoint.message()), HasSubstr("is at 32 tokens"));
  ASSERT_TRUE(c.Truncate(fork->sequence_id(), 32).ok());
  const std::vector<int32_t> rest(prompt.begin() + 32, prompt.end());
  absl::StatusOr<v1::PrefillResponse> again_from_32 = c.Prefill(fork->sequence_id(), rest);
  ASSERT_TRUE(again_from_32.ok()) << again_from_32.status();
  EXPECT_EQ(again_from_32->next_token(), alone[0]);
  EXPECT_TRUE(c.CheckInvariants()->ok());
}

TEST_F(ComputeIntegrationTest, GenerateStreamsWhatPrefillAndDecodeReturn) {
  StartDaemon();
  auto c = Connect(daemon_->dir(), "gen");
  const std::vector<int32_t> prompt = Prompt(30, 3);
  const Generated g = Converse(*c, prompt, 6);
  v1::GenerateRequest request;
  request.mutable_prompt()->Add(prompt.begin(), prompt.end());
  request.set_max_tokens(6);
  std::vector<int32_t> streamed;
  std::vector<int32_t> indexes;
  ASSERT_TRUE(c->Generate(request, [&](const v1::GenerateResponse& r) {
                 streamed.push_back(r.token());
                 indexes.push_back(r.index());
                 return true;
               }).ok());
  EXPECT_EQ(streamed, g.tokens);
  EXPECT_EQ(indexes, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  // A stop token ends the stream right after it.
  request.add_stop_tokens(g.tokens[2]);
  streamed.clear();
  ASSERT_TRUE(c->Generate(request, [&](const v1::GenerateResponse& r) {
                 streamed.push_back(r.token());
                 return true;
               }).ok());
  EXPECT_EQ(streamed, std::vector<int32_t>(g.tokens.begin(), g.tokens.begin() + 3));
  // Without free_when_done the sequences stay with the session: the two streams' and Run's.
  EXPECT_EQ(Stats(*c).sequences(), 3);
}

TEST_F(ComputeIntegrationTest, BadComputeInputGetsItsCodeAndChangesNothing) {
  StartDaemon();
  auto c = Connect(daemon_->dir(), "bad");
  auto other = Connect(daemon_->dir(), "other");
  const Generated g = Converse(*c, Prompt(20, 5), 2);
  const v1::GetStatsResponse before = Stats(*c);
  auto code = [](const absl::Status& s) { return s.code(); };
  const std::vector<int32_t> outside = {1, 2, 8192};
  EXPECT_EQ(code(c->Prefill(0, outside).status()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(c->Prefill(0, {}).status()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(c->Prefill(0, Prompt(5, 1), /*top_k=*/65).status()),
            absl::StatusCode::kInvalidArgument);
  const client::DecodeItem mine{g.sequence, 1};
  EXPECT_EQ(code(other->Decode(std::span(&mine, 1)).status()), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(code(other->Prefill(g.sequence, Prompt(3, 1)).status()),
            absl::StatusCode::kPermissionDenied);
  const client::DecodeItem missing{987654, 1};
  EXPECT_EQ(code(c->Decode(std::span(&missing, 1)).status()), absl::StatusCode::kNotFound);
  const std::vector<client::DecodeItem> twice = {mine, mine};
  EXPECT_EQ(code(c->Decode(twice).status()), absl::StatusCode::kInvalidArgument);
  const std::vector<client::DecodeItem> half_bad = {mine, {987654, 1}};
  EXPECT_EQ(code(c->Decode(half_bad).status()), absl::StatusCode::kNotFound);
  v1::GenerateRequest zero;
  zero.add_prompt(1);
  const absl::Status gen = c->Generate(zero, [](const v1::GenerateResponse&) { return true; });
  EXPECT_EQ(gen.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(gen.message()), HasSubstr("max_tokens"));

  const v1::GetStatsResponse after = Stats(*c);
  EXPECT_EQ(after.free_blocks(), before.free_blocks());
  EXPECT_EQ(after.sequences(), before.sequences());
  EXPECT_EQ(after.decode_tokens(), before.decode_tokens());
  // The sequence the failed calls named is untouched and still decodes where it was.
  const client::DecodeItem next{g.sequence, g.tokens.back()};
  absl::StatusOr<v1::DecodeResponse> r = c->Decode(std::span(&next, 1));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->num_tokens(0), 22);
}

// The decode doorbell (kvpool/v1/doorbell.h) and the Decode RPC are two transports of one call:
// same tokens, same refusals with the same codes and messages, same bookkeeping.
TEST_F(ComputeIntegrationTest, DoorbellAndRpcDecodesAgreeInEverything) {
  StartDaemon();
  auto bell = Connect(daemon_->dir(), "bell");
  absl::StatusOr<std::unique_ptr<client::Client>> rpc = client::Client::Connect(
      {.runtime_dir = daemon_->dir(), .client_name = "rpc", .decode_doorbell = false});
  ASSERT_TRUE(rpc.ok()) << rpc.status();
  ASSERT_TRUE(bell->decode_doorbell());
  ASSERT_FALSE((*rpc)->decode_doorbell());

  const std::vector<int32_t> prompt = Prompt(30, 21);
  const Generated by_bell = Converse(*bell, prompt, 10);
  const Generated by_rpc = Converse(**rpc, prompt, 10);
  EXPECT_EQ(by_bell.tokens, by_rpc.tokens);
  EXPECT_EQ(by_bell.tokens, RunLocally(prompt, 10));
  EXPECT_EQ(Stats(*bell).doorbell_calls(), 9u);  // the RPC client's nine are not among them

  // Refusals: a sequence of another session, an unknown one, one named twice, an empty batch.
  const client::DecodeItem theirs_from_bell{by_rpc.sequence, 1};
  const client::DecodeItem theirs_from_rpc{by_bell.sequence, 1};
  const client::DecodeItem missing{987654, 1};
  const client::DecodeItem mine_bell{by_bell.sequence, 1};
  const client::DecodeItem mine_rpc{by_rpc.sequence, 1};
  struct Case {
    std::vector<client::DecodeItem> bell, rpc;
  };
  const std::vector<Case> cases = {{{theirs_from_bell}, {theirs_from_rpc}},
                                   {{missing}, {missing}},
                                   {{mine_bell, mine_bell}, {mine_rpc, mine_rpc}},
                                   {{mine_bell, missing}, {mine_rpc, missing}}};
  const v1::GetStatsResponse before = Stats(*bell);
  for (const Case& c : cases) {
    const absl::Status a = bell->Decode(c.bell).status();
    const absl::Status b = (*rpc)->Decode(c.rpc).status();
    EXPECT_FALSE(a.ok());
    EXPECT_EQ(a.code(), b.code()) << a << " / " << b;
    // Messages name the sequences, which differ between the two sessions.
    if (c.bell[0].sequence_id == c.rpc[0].sequence_id) {
      EXPECT_EQ(a.message(), b.message());
    }
  }
  const v1::GetStatsResponse after = Stats(*bell);
  EXPECT_EQ(after.doorbell_calls(), before.doorbell_calls() + cases.size());
  EXPECT_EQ(after.decode_tokens(), before.decode_tokens());
  EXPECT_EQ(after.sequences(), before.sequences());
  EXPECT_EQ(after.free_blocks(), before.free_blocks());

  // Both sequences still decode where they were: the refused calls changed nothing.
  for (const auto& [c, g] : {std::pair{bell.get(), &by_bell}, std::pair{rpc->get(), &by_rpc}}) {
    const client::DecodeItem next{g->sequence, g->tokens.back()};
    absl::StatusOr<v1::DecodeResponse> r = c->Decode(std::span(&next, 1));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->num_tokens(0), 40);
  }
  // top_k is answered over gRPC, by the same client.
  const client::DecodeItem next{by_bell.sequence, 5};
  absl::StatusOr<v1::DecodeResponse> top = bell->Decode(std::span(&next, 1), /*top_k=*/3);
  ASSERT_TRUE(top.ok()) << top.status();
  EXPECT_EQ(top->top(0).tokens_size(), 3);
  EXPECT_EQ(Stats(*bell).doorbell_calls(), after.doorbell_calls() + 1);
}

TEST_F(ComputeIntegrationTest, DaemonWithoutModelRefusesComputeCalls) {
  StartDaemon(R"pb(pool_bytes: 16777216
                   model { name: "none" })pb");
  auto c = Connect(daemon_->dir(), "nomodel");
  EXPECT_FALSE(c->decode_doorbell());  // nothing to ring for
  const absl::Status s = c->Prefill(0, Prompt(4, 1)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("no model"));
  // Control calls still work, for a session with KV access: the compute-only one may not take
  // blocks to write.
  EXPECT_EQ(c->Allocate(Prompt(4, 1)).status().code(), absl::StatusCode::kPermissionDenied);
  absl::StatusOr<std::unique_ptr<client::Client>> kv = client::Client::Connect(
      {.runtime_dir = daemon_->dir(), .client_name = "nomodel-kv", .kv_access = true});
  ASSERT_TRUE(kv.ok()) << kv.status();
  EXPECT_TRUE((*kv)->Allocate(Prompt(4, 1)).ok());
}

TEST_F(ComputeIntegrationTest, DaemonServesAHuggingFaceCheckpoint) {
  // A small untied checkpoint in bf16, written the way transformers writes one.
  const model::ModelConfig config{.vocab_size = 512,
                                  .hidden_size = 128,
                                  .intermediate_size = 256,
                                  .num_layers = 2,
                                  .num_heads = 4,
                                  .num_kv_heads = 2,
                                  .head_dim = 32,
                                  .tie_word_embeddings = false};
  char tmpl[] = "/tmp/kvpool-checkpoint-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  ASSERT_TRUE(model::SaveCheckpoint(model::SyntheticWeights(config, 3), dir, "bf16").ok());
  // The pool's shape follows the checkpoint: no shape in the config.
  StartDaemon("pool_bytes: 16777216 model { checkpoint: \"" + dir + "\" }");
  auto c = Connect(daemon_->dir(), "hf");
  EXPECT_EQ(c->model_name(), dir);
  EXPECT_EQ(c->model_vocab_size(), 512);
  EXPECT_EQ(c->layout().num_layers(), 2);
  EXPECT_EQ(c->layout().num_kv_heads(), 2);
  EXPECT_EQ(c->layout().head_dim(), 32);
  std::vector<int32_t> prompt = Prompt(25, 4);
  for (int32_t& t : prompt) t %= 512;
  const Generated g = Converse(*c, prompt, 6);

  absl::StatusOr<model::ModelWeights> loaded = model::LoadCheckpoint(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto engine = model::LocalEngine::Create(*std::move(loaded), {.pool_bytes = 4 << 20});
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto first = (*engine)->Prefill(SequenceId(0), prompt);
  ASSERT_TRUE(first.ok());
  std::vector<int32_t> local = {first->result.next_token};
  while (local.size() < 6) {
    const model::DecodeInput in{first->sequence, local.back()};
    local.push_back((*(*engine)->Decode(std::span(&in, 1)))[0].next_token);
  }
  EXPECT_EQ(g.tokens, local);
  std::filesystem::remove_all(dir);
}

// Through the doorbell ("decode") and through the Decode RPC ("decode_rpc").
TEST_F(ComputeIntegrationTest, ClientKilledWhileDecodingLeavesNothingBehind) {
  for (const std::string mode : {"decode", "decode_rpc"}) {
    SCOPED_TRACE(mode);
    KillWhileDecoding(mode);
  }
}

void ComputeIntegrationTest::KillWhileDecoding(const std::string& mode) {
  StartDaemon();
  auto admin = Connect(daemon_->dir(), "admin");
  absl::StatusOr<Child> child = Spawn({IntegrationClientBinary(), mode, daemon_->dir(), "30", "9"});
  ASSERT_TRUE(child.ok());
  absl::StatusOr<std::string> line = ReadLine(*child, absl::Seconds(30));
  ASSERT_TRUE(line.ok()) << line.status();
  ASSERT_EQ(*line, "decoding");
  kill(child->pid, SIGKILL);
  Wait(&*child);
  // The daemon notices the closed attach socket and releases the sequence, fenced behind any
  // step still using its blocks.
  v1::GetStatsResponse s;
  for (int i = 0; i < 200; ++i) {
    s = Stats(*admin);
    if (s.sequences() == 0 && s.active_blocks() == 0 && s.retiring_blocks() == 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(s.sequences(), 0);
  EXPECT_GT(s.decode_tokens(), 0u);
  if (mode == "decode") {
    EXPECT_GT(s.doorbell_calls(), 0u);
  } else {
    EXPECT_EQ(s.doorbell_calls(), 0u);
  }
  EXPECT_EQ(s.active_blocks(), 0);
  EXPECT_EQ(s.retiring_blocks(), 0);
  EXPECT_TRUE(admin->CheckInvariants()->ok());
}

}  // namespace
}  // namespace kvpool::testing

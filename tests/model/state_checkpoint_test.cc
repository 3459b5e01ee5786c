// State checkpoints taken inside a model step (issue 28, docs/hybrid-groups.md §4): with the
// tiny-hybrid preset on the host, a mixed step's checkpoints each hold bit for bit the state a
// step ending there leaves, while the step's results, K/V and states are bit for bit those of the
// same step without checkpoints; bad checkpoints are refused before anything changes.

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu_isa.h"
#include "kvpool/util/check.h"
#include "model/model.h"
#include "tests/model/dense_reference.h"

namespace kvpool::model {
namespace {

using ::testing::HasSubstr;

// Gemm's vector path sums each output in the order of k whatever the rows; OpenBLAS (the
// fallback without AVX2) promises nothing of the kind.
bool ExactResume() { return kernels::cpu::KernelIsa() != kernels::cpu::Isa::kPortable; }

constexpr int32_t kBlockSize = 16;
constexpr int32_t kBlocks = 32;
constexpr int32_t kSlots = 16;

// A zeroed host arena laid out as `layout`: KV blocks, then (with state layers) state slots.
class Arena {
 public:
  explicit Arena(const kernels::PoolLayout& layout) : layout_(layout) {
    bytes_ = (layout.arena_bytes() + 4095) / 4096 * 4096;
    data_.reset(static_cast<char*>(std::aligned_alloc(4096, static_cast<size_t>(bytes_))));
    std::memset(data_.get(), 0, static_cast<size_t>(bytes_));
  }
  kernels::KvPoolView view() const { return {data_.get(), layout_}; }
  // Slot `slot`'s state, `floats` of them.
  std::span<float> slot(int32_t slot, int64_t floats) const {
    return {reinterpret_cast<float*>(view().state(slot)), static_cast<size_t>(floats)};
  }
  std::vector<char> kv() const { return {data_.get(), data_.get() + layout_.kv_bytes()}; }
  std::vector<char> all() const { return {data_.get(), data_.get() + bytes_}; }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  kernels::PoolLayout layout_;
  int64_t bytes_ = 0;
  std::unique_ptr<char, Free> data_;
};

std::vector<float> Copy(std::span<const float> s) { return {s.begin(), s.end()}; }

std::vector<int32_t> Table(int32_t first, int32_t n) {
  std::vector<int32_t> t;
  for (int32_t b = 0; b < n; ++b) t.push_back(first + b);
  return t;
}

void ExpectSameResult(const ItemResult& got, const ItemResult& want, size_t item) {
  EXPECT_EQ(got.next_token, want.next_token) << "item " << item;
  EXPECT_TRUE(got.logits == want.logits) << "item " << item;
  EXPECT_EQ(std::memcmp(&got.logprob, &want.logprob, sizeof(float)), 0) << "item " << item;
  ASSERT_EQ(got.top.size(), want.top.size()) << "item " << item;
  for (size_t k = 0; k < got.top.size(); ++k) {
    EXPECT_EQ(got.top[k].token, want.top[k].token) << "item " << item << " top " << k;
    EXPECT_EQ(got.top[k].logprob, want.top[k].logprob) << "item " << item << " top " << k;
  }
}

class StateCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_ = *NamedConfig("tiny-hybrid");
    weights_ = SyntheticWeights(config_, 5);
    floats_ = config_.state_bytes() / 4;
    layout_ = {.block_size = kBlockSize,
               .num_layers = config_.pool_layers(),
               .num_kv_heads = config_.num_kv_heads,
               .head_dim = config_.head_dim,
               .dtype = kernels::DType::kBF16,
               .num_blocks = kBlocks,
               .num_state_slots = kSlots,
               .state_slot_bytes = (config_.state_bytes() + 63) / 64 * 64};
    auto model = Model::Create(weights_, layout_, {.threads = 2});
    KVPOOL_CHECK_OK(model.status());
    model_ = std::move(*model);
  }

  // One item's step (from a zero state when start is 0) in `arena`, its state in `slot`.
  void Run(const Arena& arena, std::span<const int32_t> tokens, int64_t start,
           std::span<const int32_t> table, int32_t slot) {
    const StepItem item{
        .tokens = tokens, .start = start, .block_table = table, .state = arena.slot(slot, floats_)};
    std::vector<ItemResult> results;
    KVPOOL_CHECK_OK(model_->Step(arena.view(), std::span(&item, 1), {}, &results));
  }

  // The state after the first `n` tokens, computed as one prefill from a zero state.
  std::vector<float> StateAfter(std::span<const int32_t> tokens, int64_t n) {
    Arena fresh(layout_);
    Run(fresh, tokens.first(static_cast<size_t>(n)), 0, Table(0, kBlocks), 0);
    return Copy(fresh.slot(0, floats_));
  }

  ModelConfig config_;
  ModelWeights weights_;
  int64_t floats_ = 0;
  kernels::PoolLayout layout_;
  std::unique_ptr<Model> model_;
};

// A mixed step: a 130-token prefill from nothing (three of the prefill kernel's 64-key chunks,
// more rows than the decode-sized products take; longer costs seconds under the sanitizers), a
// 37-token turn after 20 cached tokens and a decode after 45, with checkpoints at the first
// token, the last, on and off block boundaries, two adjacent ones (a one-token piece in the
// middle) and one before the last token (a one-token last piece); the second item samples with
// penalties.
struct Mixed {
  struct Seq {
    std::vector<int32_t> tokens;  // all of the sequence's: earlier ones, then the step's
    int64_t start = 0;            // tokens before the step
    int32_t first_block = 0;      // its table: blocks [first_block, first_block + blocks)
    int32_t blocks = 0;
    int32_t slot = 0;
    std::vector<int64_t> offsets;  // checkpoints
  };
  std::vector<Seq> seqs;
  SamplingParams sampling{.temperature = 0.8f, .top_p = 0.9f, .presence_penalty = 0.5f, .seed = 11};

  Mixed() {
    seqs.push_back({RandomTokens(130, 8192, 1), 0, 0, 9, 0, {1, 64, 65, 129, 130}});
    seqs.push_back({RandomTokens(57, 8192, 2), 20, 9, 4, 1, {1, 17, 37}});
    seqs.push_back({RandomTokens(46, 8192, 3), 45, 13, 3, 2, {1}});
  }
  std::span<const int32_t> step_tokens(size_t i) const {
    return std::span(seqs[i].tokens).subspan(static_cast<size_t>(seqs[i].start));
  }
};

TEST_F(StateCheckpointTest, CheckpointsAreExactAndTheStepIsUnchanged) {
  if (!ExactResume()) GTEST_SKIP() << "no AVX2: products go through OpenBLAS";
  const Mixed mixed;
  const StepOptions options{.top_k = 5, .keep_logits = true, .logprobs = true};
  Arena with(layout_), without(layout_);
  std::vector<std::vector<int32_t>> tables;
  for (const Mixed::Seq& s : mixed.seqs) tables.push_back(Table(s.first_block, s.blocks));
  // The earlier tokens of the second and third sequences, alike in both arenas.
  for (const Arena* arena : {&with, &without}) {
    for (size_t i = 1; i < mixed.seqs.size(); ++i) {
      const Mixed::Seq& s = mixed.seqs[i];
      Run(*arena, std::span(s.tokens).first(static_cast<size_t>(s.start)), 0, tables[i], s.slot);
    }
  }
  // Checkpoints in the slots after the sequences' own.
  std::vector<std::vector<StateCheckpoint>> checkpoints(mixed.seqs.size());
  int32_t slot = 3;
  for (size_t i = 0; i < mixed.seqs.size(); ++i) {
    for (int64_t offset : mixed.seqs[i].offsets) {
      checkpoints[i].push_back({.offset = offset, .state = with.slot(slot++, floats_)});
    }
  }
  ASSERT_LE(slot, kSlots);
  const auto items = [&](const Arena& arena, bool take) {
    std::vector<StepItem> out;
    for (size_t i = 0; i < mixed.seqs.size(); ++i) {
      const Mixed::Seq& s = mixed.seqs[i];
      out.push_back(
          {.tokens = mixed.step_tokens(i),
           .start = s.start,
           .block_table = tables[i],
           .sampling = i == 1 ? &mixed.sampling : nullptr,
           .history = std::span(s.tokens),
           .state = arena.slot(s.slot, floats_),
           .checkpoints = take ? std::span(checkpoints[i]) : std::span<StateCheckpoint>()});
    }
    return out;
  };
  std::vector<ItemResult> got, want;
  ASSERT_TRUE(model_->Step(without.view(), items(without, false), options, &want).ok());
  const absl::Status stepped = model_->Step(with.view(), items(with, true), options, &got);
  ASSERT_TRUE(stepped.ok()) << stepped;

  // The step itself: results, K/V and states as without checkpoints, bit for bit.
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) ExpectSameResult(got[i], want[i], i);
  EXPECT_TRUE(with.kv() == without.kv());
  for (const Mixed::Seq& s : mixed.seqs) {
    EXPECT_EQ(Copy(with.slot(s.slot, floats_)), Copy(without.slot(s.slot, floats_)))
        << "sequence in slot " << s.slot;
  }
  // Each checkpoint: the state a step ending there leaves. Inside an item that is one prefill of
  // the tokens up to there from a zero state; at its end, the step without checkpoints.
  for (size_t i = 0; i < mixed.seqs.size(); ++i) {
    const Mixed::Seq& s = mixed.seqs[i];
    for (const StateCheckpoint& cp : checkpoints[i]) {
      SCOPED_TRACE("item " + std::to_string(i) + " offset " + std::to_string(cp.offset));
      const std::vector<float> expected =
          static_cast<size_t>(cp.offset) == mixed.step_tokens(i).size()
              ? Copy(without.slot(s.slot, floats_))
              : StateAfter(s.tokens, s.start + cp.offset);
      EXPECT_TRUE(Copy(cp.state) == expected);
    }
  }
}

// A step of decodes only, one with a checkpoint at offset 1: the copy of its final state, and
// the step as without.
TEST_F(StateCheckpointTest, ADecodeStepTakesItsCheckpointAtOne) {
  if (!ExactResume()) GTEST_SKIP() << "no AVX2: products go through OpenBLAS";
  Arena with(layout_), without(layout_);
  const std::vector<int32_t> a = RandomTokens(9, 8192, 4), b = RandomTokens(30, 8192, 5);
  const std::vector<int32_t> ta = Table(0, 2), tb = Table(2, 2);
  for (const Arena* arena : {&with, &without}) {
    Run(*arena, std::span(a).first(8), 0, ta, 0);
    Run(*arena, std::span(b).first(29), 0, tb, 1);
  }
  const StateCheckpoint cp{.offset = 1, .state = with.slot(2, floats_)};
  const auto items = [&](const Arena& arena, bool take) {
    return std::vector<StepItem>{
        {.tokens = std::span(a).last(1),
         .start = 8,
         .block_table = ta,
         .state = arena.slot(0, floats_)},
        {.tokens = std::span(b).last(1),
         .start = 29,
         .block_table = tb,
         .state = arena.slot(1, floats_),
         .checkpoints = take ? std::span(&cp, 1) : std::span<const StateCheckpoint>()}};
  };
  std::vector<ItemResult> got, want;
  ASSERT_TRUE(
      model_->Step(without.view(), items(without, false), {.keep_logits = true}, &want).ok());
  ASSERT_TRUE(model_->Step(with.view(), items(with, true), {.keep_logits = true}, &got).ok());
  ASSERT_EQ(got.size(), 2u);
  for (size_t i = 0; i < 2; ++i) ExpectSameResult(got[i], want[i], i);
  EXPECT_TRUE(with.kv() == without.kv());
  EXPECT_TRUE(Copy(cp.state) == Copy(without.slot(1, floats_)));
  EXPECT_TRUE(Copy(with.slot(1, floats_)) == Copy(without.slot(1, floats_)));
  EXPECT_TRUE(Copy(with.slot(0, floats_)) == Copy(without.slot(0, floats_)));
}

// Every bad checkpoint is INVALID_ARGUMENT, naming the fault, and leaves the arena (K/V, states
// and checkpoint slots) as it was.
TEST_F(StateCheckpointTest, BadCheckpointsAreRefusedAndChangeNothing) {
  Arena arena(layout_);
  const std::vector<int32_t> a = RandomTokens(20, 8192, 6), b = RandomTokens(5, 8192, 7);
  const std::vector<int32_t> ta = Table(0, 2), tb = Table(2, 1);
  Run(arena, std::span(a).first(10), 0, ta, 0);
  for (int32_t s = 2; s < kSlots; ++s) {
    for (float& f : arena.slot(s, floats_)) f = static_cast<float>(s);
  }
  const std::vector<char> before = arena.all();
  const std::span<float> s2 = arena.slot(2, floats_), s3 = arena.slot(3, floats_);
  struct Case {
    std::string name;
    std::vector<StateCheckpoint> checkpoints;  // the first item's
    std::string says;
  };
  const std::vector<Case> cases = {
      {"offset 0", {{0, s2}}, "offsets must rise strictly within [1, 10]"},
      {"past the tokens", {{11, s2}}, "at offset 11"},
      {"not ascending", {{5, s2}, {3, s3}}, "checkpoint 1 at offset 3"},
      {"twice at one offset", {{5, s2}, {5, s3}}, "checkpoint 1 at offset 5"},
      {"short", {{5, s2.first(s2.size() - 1)}}, "checkpoint 0 has"},
      {"long", {{5, std::span(s2.data(), s2.size() + 1)}}, "checkpoint 0 has"},
      {"on its own state", {{5, arena.slot(0, floats_)}}, "overlaps"},
      {"on the other item's state", {{5, arena.slot(1, floats_)}}, "overlaps"},
      {"on another checkpoint", {{4, s2}, {8, s2}}, "overlaps"},
      {"across another checkpoint",
       {{4, s2}, {8, std::span(s2.data() + 16, s2.size())}},
       "item 0's checkpoint 0 overlaps item 0's checkpoint 1"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<StepItem> items = {
        {.tokens = std::span(a).last(10),
         .start = 10,
         .block_table = ta,
         .state = arena.slot(0, floats_),
         .checkpoints = c.checkpoints},
        {.tokens = b, .start = 0, .block_table = tb, .state = arena.slot(1, floats_)}};
    std::vector<ItemResult> results;
    const absl::Status s = model_->Step(arena.view(), items, {}, &results);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.says));
    EXPECT_TRUE(arena.all() == before);
  }
}

// A model without state-space layers takes no checkpoints.
TEST(StateCheckpointPlainModelTest, RefusesCheckpointsWithoutStateLayers) {
  const ModelConfig c = *NamedConfig("tiny");
  const kernels::PoolLayout layout{.block_size = kBlockSize,
                                   .num_layers = c.num_layers,
                                   .num_kv_heads = c.num_kv_heads,
                                   .head_dim = c.head_dim,
                                   .num_blocks = 4};
  auto model = Model::Create(SyntheticWeights(c, 1), layout, {.threads = 1});
  ASSERT_TRUE(model.ok()) << model.status();
  Arena arena(layout);
  std::vector<float> buffer(64, 2.0f);
  const StateCheckpoint cp{.offset = 1, .state = buffer};
  const std::vector<int32_t> tokens = {3, 4}, table = {0};
  const StepItem item{.tokens = tokens, .block_table = table, .checkpoints = std::span(&cp, 1)};
  std::vector<ItemResult> results;
  const absl::Status s = (*model)->Step(arena.view(), std::span(&item, 1), {}, &results);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("no state-space layers"));
  EXPECT_TRUE(arena.all() == std::vector<char>(arena.all().size(), 0));
  EXPECT_EQ(buffer, std::vector<float>(64, 2.0f));
}

// A step model that cannot copy states (one that does not override CopyStates: a wrapper, say)
// refuses a step with checkpoints before running any of it.
class Wrapper final : public StepModel {
 public:
  explicit Wrapper(Model* inner) : inner_(inner) {}
  const ModelConfig& config() const override { return inner_->config(); }
  const kernels::PoolLayout& layout() const override { return inner_->layout(); }
  std::string where() const override { return inner_->where(); }
  int64_t weight_bytes() const override { return inner_->weight_bytes(); }

 protected:
  absl::Status RunStep(const kernels::KvPoolView& pool, std::span<const StepItem> items,
                       const StepOptions& options, std::vector<ItemResult>* results) override {
    return inner_->Step(pool, items, options, results);
  }

 private:
  Model* inner_;
};

TEST_F(StateCheckpointTest, AModelThatCannotCopyStatesRefusesBeforeRunning) {
  Wrapper wrapper(model_.get());
  Arena arena(layout_);
  const std::vector<int32_t> tokens = RandomTokens(8, 8192, 8), table = {0};
  const StateCheckpoint cp{.offset = 4, .state = arena.slot(1, floats_)};
  const StepItem item{.tokens = tokens,
                      .block_table = table,
                      .state = arena.slot(0, floats_),
                      .checkpoints = std::span(&cp, 1)};
  std::vector<ItemResult> results;
  EXPECT_EQ(wrapper.Step(arena.view(), std::span(&item, 1), {}, &results).code(),
            absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(arena.all() == std::vector<char>(arena.all().size(), 0));
  // Without checkpoints the wrapper steps as ever.
  const StepItem plain{.tokens = tokens, .block_table = table, .state = arena.slot(0, floats_)};
  EXPECT_TRUE(wrapper.Step(arena.view(), std::span(&plain, 1), {}, &results).ok());
}

}  // namespace
}  // namespace kvpool::model

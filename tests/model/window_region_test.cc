// The window group's region (issue 28 step 2, docs/hybrid-groups.md §2-§3) as the model reads
// it, on every backend (backend_test_util.h: the CUDA cases skip without a GPU): sliding layers
// write and read their K/V through each sequence's window table, in window blocks of their own.
// Held bit for bit (f32) against the same steps over a pool that keeps every token in its main
// blocks, while a hand-driven window table releases the blocks that leave the window (-1), poisons
// them (NaN) and hands them to another sequence. Step's checks of the window table, CheckModel's of
// the window group, and a model with full, window and state-space layers over a pool with a window
// region and state slots.

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/util/check.h"
#include "kvpool/util/status_macros.h"
#include "model/model.h"
#include "model/step_model.h"
#include "tests/kernels/backend_test_util.h"
#include "tests/model/dense_reference.h"

namespace kvpool::model {
namespace {

using ::testing::HasSubstr;

const StepOptions kLogits{.keep_logits = true};
const LayerKind kS = LayerKind::kStateSpace, kF = LayerKind::kFullAttention,
                kW = LayerKind::kSlidingAttention;

// One pool (an arena of its own on a backend's device, zeroed) and the backend's model over it.
struct Rig {
  kernels::Device* device = nullptr;
  kernels::PoolLayout layout;
  std::unique_ptr<kernels::Arena> arena;
  kernels::KvPoolView view;
  std::unique_ptr<StepModel> model;

  // `bytes` from `at` (a device address in the arena), on the host.
  template <typename T>
  std::vector<T> Read(const void* at, int64_t bytes) const {
    auto v = kernels::test_util::Download<T>(*device, at, static_cast<size_t>(bytes) / sizeof(T));
    KVPOOL_CHECK_OK(v.status());
    return *std::move(v);
  }
  std::vector<char> Bytes() const { return Read<char>(view.base, layout.arena_bytes()); }
  std::span<float> State(int32_t slot) const {
    return {reinterpret_cast<float*>(view.state(slot)),
            static_cast<size_t>(model->state_bytes() / 4)};
  }
};

// `window_blocks` > 0: the model's sliding layers in a window region of that many blocks.
absl::StatusOr<Rig> MakeRig(kernels::Device* device, const ModelWeights& w, int32_t block_size,
                            int32_t blocks, int32_t window_blocks, int32_t state_slots = 0) {
  const ModelConfig& c = w.config;
  Rig r;
  r.device = device;
  r.layout = {.block_size = block_size,
              .num_layers = c.pool_layers(),
              .num_kv_heads = c.num_kv_heads,
              .head_dim = c.head_dim,
              .dtype = kernels::DType::kF32,
              .num_blocks = blocks,
              .num_state_slots = state_slots,
              .state_slot_bytes = state_slots > 0 ? (c.state_bytes() + 63) / 64 * 64 : 0,
              .num_window_layers = window_blocks > 0 ? c.num_sliding_layers() : 0,
              .num_window_blocks = window_blocks};
  KVPOOL_RETURN_IF_ERROR(kernels::ValidateLayout(r.layout));
  KVPOOL_ASSIGN_OR_RETURN(r.arena, device->CreateArena(r.layout.arena_bytes()));
  const std::vector<char> zeros(static_cast<size_t>(r.layout.arena_bytes()), 0);
  KVPOOL_ASSIGN_OR_RETURN(Fence zeroed,
                          device->CopyToDevice(kernels::StreamId::kTransfer, r.arena->base(),
                                               zeros.data(), r.layout.arena_bytes()));
  KVPOOL_RETURN_IF_ERROR(device->Synchronize(zeroed));
  r.view = {r.arena->base(), r.layout};
  KVPOOL_ASSIGN_OR_RETURN(r.model, CreateStepModel(w, r.layout, device, /*threads=*/2));
  return r;
}

// A sequence in both pools: the same main block ids in each, and a window table in the window
// pool's window group.
struct Seq {
  std::vector<int32_t> tokens;  // every token it will hold (prompt, then what the steps predict)
  int64_t len = 0;              // tokens in the pools
  std::vector<int32_t> table;
  std::vector<int32_t> window;
  int32_t slot = 0;  // state slot (models with state-space layers)
};

// The window pool's bookkeeping, as the core keeps it (kvpool's window group), by hand: blocks
// are taken from a LIFO free list (so a block one sequence released is the next another takes),
// and after each step the blocks wholly before the next query's window (sinks aside) are
// released: the entry becomes -1 and the block is poisoned (NaN) before it goes back to the list.
class WindowTables {
 public:
  WindowTables(const Rig& rig, kernels::AttentionWindow window) : rig_(&rig), window_(window) {
    for (int32_t b = rig.layout.num_window_blocks - 1; b >= 0; --b) free_.push_back(b);
  }

  // Grows `s` to `end` tokens: main blocks from `next_main`, window blocks from the free list.
  void Grow(Seq& s, int64_t end, int32_t* next_main) {
    const int64_t bs = rig_->layout.block_size;
    while (static_cast<int64_t>(s.table.size()) * bs < end) {
      s.table.push_back((*next_main)++);
      ASSERT_FALSE(free_.empty()) << "the window region is too small for the test";
      s.window.push_back(free_.back());
      free_.pop_back();
    }
  }

  // After a step that left `s` at s.len tokens.
  void Release(Seq& s) {
    const int64_t bs = rig_->layout.block_size;
    const int64_t start = window_.Start(s.len);
    for (int64_t b = 0; (b + 1) * bs <= start; ++b) {
      if (b * bs < window_.sinks || s.window[static_cast<size_t>(b)] < 0) continue;
      const int32_t id = s.window[static_cast<size_t>(b)];
      Poison(id);
      free_.push_back(id);
      s.window[static_cast<size_t>(b)] = -1;
      ++released_;
    }
    const auto live =
        std::count_if(s.window.begin(), s.window.end(), [](int32_t b) { return b >= 0; });
    max_live_ = std::max<int64_t>(max_live_, live);
  }

  int64_t released() const { return released_; }
  int64_t max_live() const { return max_live_; }

 private:
  void Poison(int32_t id) {
    kernels::Device& device = *rig_->device;
    auto ids = kernels::test_util::Upload(device, &id, 1);
    KVPOOL_CHECK_OK(ids.status());
    auto fence = device.FillBlocks(kernels::StreamId::kCompute, rig_->view.Window(),
                                   {.num_blocks = 1,
                                    .blocks = static_cast<const int32_t*>((*ids)->data()),
                                    .pattern = kernels::FillPattern::kPoison});
    KVPOOL_CHECK_OK(fence.status());
    KVPOOL_CHECK_OK(device.Synchronize(*fence));
  }

  const Rig* rig_;
  kernels::AttentionWindow window_;
  std::vector<int32_t> free_;
  int64_t released_ = 0;
  int64_t max_live_ = 0;
};

// One part of a step: `n` new tokens of sequence `s`.
struct Part {
  Seq* seq;
  int64_t n;
};

// Equal bit for bit on the host; on a GPU within `tolerance` (two models of one shape on one GPU
// should agree bit for bit too, but cuBLAS does not promise it across handles).
void ExpectSame(std::span<const float> got, std::span<const float> want, double tolerance,
                const std::string& what) {
  if (tolerance == 0) {
    EXPECT_EQ(std::memcmp(got.data(), want.data(), std::min(got.size(), want.size()) * 4), 0)
        << what;
    EXPECT_EQ(got.size(), want.size()) << what;
  } else {
    EXPECT_LE(RelError(got, want), tolerance) << what;
  }
}

// Runs a step on both rigs and holds the window pool's results, logits, states and K/V of every
// live block to the reference's. Each sequence's next token is what the reference predicted
// (appended to its tokens when it has no more).
class Parity {
 public:
  Parity(const ModelWeights& w, Rig& ref, Rig& win, double tolerance)
      : c_(w.config),
        ref_(ref),
        win_(win),
        tolerance_(tolerance),
        tables_(win, w.config.window(FirstSliding())) {}

  void Step(std::vector<Part> parts) {
    std::vector<StepItem> a, b;
    for (const Part& p : parts) {
      Seq& s = *p.seq;
      tables_.Grow(s, s.len + p.n, &next_main_);
      const std::span<const int32_t> tokens(s.tokens.data() + s.len, static_cast<size_t>(p.n));
      StepItem item{.tokens = tokens, .start = s.len, .block_table = s.table};
      if (c_.num_state_layers() > 0) item.state = ref_.State(s.slot);
      a.push_back(item);
      if (c_.num_state_layers() > 0) item.state = win_.State(s.slot);
      item.window_table = s.window;
      b.push_back(item);
    }
    std::vector<ItemResult> ra, rb;
    ASSERT_TRUE(ref_.model->Step(ref_.view, a, kLogits, &ra).ok());
    const absl::Status s = win_.model->Step(win_.view, b, kLogits, &rb);
    ASSERT_TRUE(s.ok()) << s;
    for (size_t i = 0; i < parts.size(); ++i) {
      Seq& seq = *parts[i].seq;
      const std::string at = "step " + std::to_string(steps_) + " item " + std::to_string(i);
      EXPECT_EQ(rb[i].next_token, ra[i].next_token) << at;
      ExpectSame(rb[i].logits, ra[i].logits, tolerance_, at + " logits");
      seq.len += parts[i].n;
      if (static_cast<int64_t>(seq.tokens.size()) == seq.len)
        seq.tokens.push_back(ra[i].next_token);
      if (c_.num_state_layers() > 0) {
        ExpectSame(win_.Read<float>(win_.State(seq.slot).data(), c_.state_bytes()),
                   ref_.Read<float>(ref_.State(seq.slot).data(), c_.state_bytes()), tolerance_,
                   at + " state");
      }
      ExpectSameKv(seq, at);
      tables_.Release(seq);
    }
    ++steps_;
  }

  const WindowTables& tables() const { return tables_; }
  int64_t window_blocks_compared() const { return window_compared_; }

 private:
  int32_t FirstSliding() const {
    for (int32_t l = 0; l < c_.num_layers; ++l) {
      if (c_.kind(l) == kW) return l;
    }
    return 0;
  }

  // Every attention layer's K and V of every token the sequence holds, where the window pool
  // still has it (sliding layers: live window entries only).
  void ExpectSameKv(const Seq& s, const std::string& at) {
    const int64_t bs = ref_.layout.block_size;
    for (int32_t l = 0; l < c_.num_layers; ++l) {
      if (c_.kind(l) == kS) continue;
      const kernels::KvLayerView r = ref_.view.Layer(c_.kv_layer(l));
      const kernels::KvLayerView w = win_.view.Layer(c_.kv_layer(l, true));
      for (int64_t b = 0; b * bs < s.len; ++b) {
        const int32_t rid = s.table[static_cast<size_t>(b)];
        const int32_t wid = c_.kind(l) == kW ? s.window[static_cast<size_t>(b)] : rid;
        if (wid < 0) continue;
        window_compared_ += c_.kind(l) == kW ? 1 : 0;
        const int64_t rows = std::min(bs, s.len - b * bs);
        const std::string what = at + " layer " + std::to_string(l) + " block " + std::to_string(b);
        ExpectSame(win_.Read<float>(w.k(wid), rows * r.l.k_row_bytes),
                   ref_.Read<float>(r.k(rid), rows * r.l.k_row_bytes), tolerance_, what + " K");
        ExpectSame(win_.Read<float>(w.v(wid), rows * r.l.v_row_bytes),
                   ref_.Read<float>(r.v(rid), rows * r.l.v_row_bytes), tolerance_, what + " V");
      }
    }
  }

  const ModelConfig& c_;
  Rig& ref_;
  Rig& win_;
  double tolerance_;
  WindowTables tables_;
  int32_t next_main_ = 0;
  int steps_ = 0;
  int64_t window_compared_ = 0;
};

// SmallTestConfig with the given layers; state-space layers as hybrid_model_test's.
ModelConfig Layers(std::vector<LayerKind> kinds, int32_t window, int32_t sinks) {
  ModelConfig c = SmallTestConfig();
  c.num_layers = static_cast<int32_t>(kinds.size());
  c.layer_kinds = std::move(kinds);
  c.sliding_window = window;
  c.sink_tokens = sinks;
  if (c.num_state_layers() > 0) {
    c.ssm = {.num_heads = 4, .head_dim = 16, .d_state = 8, .num_groups = 2, .conv_width = 4};
  }
  return c;
}

// Sequence A prefills in chunks across the window's edge (and several windows long), B joins
// with a prefill beside A's chunk, takes blocks A released, then both decode together.
struct Scenario {
  std::vector<int64_t> a_chunks;
  int64_t b_prompt = 0;
  int decodes = 0;
  int32_t block_size = 0, blocks = 0, window_blocks = 0, state_slots = 0;
};

class WindowRegionTest : public kernels::test_util::BackendTest<> {
 protected:
  void RunTwoSequences(const ModelWeights& w, const Scenario& sc) {
    absl::StatusOr<Rig> ref = MakeRig(&device(), w, sc.block_size, sc.blocks, 0, sc.state_slots);
    KVPOOL_SKIP_UNAVAILABLE(backend(), ref.status());
    ASSERT_TRUE(ref.ok()) << ref.status();
    absl::StatusOr<Rig> win =
        MakeRig(&device(), w, sc.block_size, sc.blocks, sc.window_blocks, sc.state_slots);
    ASSERT_TRUE(win.ok()) << win.status();
    Parity parity(w, *ref, *win, backend() == "cpu" ? 0.0 : 1e-5);
    int64_t a_len = 0;
    for (int64_t n : sc.a_chunks) a_len += n;
    const int32_t vocab = w.config.vocab_size;
    Seq a{.tokens = RandomTokens(static_cast<size_t>(a_len), vocab, 11), .slot = 0};
    Seq b{.tokens = RandomTokens(static_cast<size_t>(sc.b_prompt), vocab, 12),
          .slot = sc.state_slots > 1 ? 1 : 0};
    parity.Step({{&a, sc.a_chunks[0]}});
    ASSERT_GT(parity.tables().released(), 0) << "the first chunk must leave some blocks behind";
    parity.Step({{&a, sc.a_chunks[1]}, {&b, sc.b_prompt}});
    for (size_t k = 2; k < sc.a_chunks.size(); ++k) parity.Step({{&a, sc.a_chunks[k]}, {&b, 1}});
    for (int d = 0; d < sc.decodes; ++d) parity.Step({{&a, 1}, {&b, 1}});
    const int64_t bs = sc.block_size, window = w.config.sliding_window,
                  sinks = w.config.sink_tokens;
    EXPECT_GT(parity.window_blocks_compared(), 0);
    // What a sequence holds in the window group between steps is bounded by its window, not its
    // length (issue 28: ceil((W + block_size) / block_size) blocks, plus the sinks').
    EXPECT_LE(parity.tables().max_live(), (window + 2 * bs - 1) / bs + (sinks + bs - 1) / bs);
    EXPECT_LT(std::count_if(a.window.begin(), a.window.end(), [](int32_t id) { return id >= 0; }),
              static_cast<int64_t>(a.window.size()) / 2);
  }
};

// tiny-swa (full and window-256 layers alternating): a sequence of over three windows, prefilled
// in three chunks that cross the window's edge, then decoded beside a second sequence.
TEST_P(WindowRegionTest, TinySwaOverAWindowRegionEqualsAPoolKeepingEveryToken) {
  absl::StatusOr<ModelConfig> c = NamedConfig("tiny-swa");
  ASSERT_TRUE(c.ok());
  RunTwoSequences(SyntheticWeights(*c, 3), {.a_chunks = {300, 260, 250},
                                            .b_prompt = 90,
                                            .decodes = 6,
                                            .block_size = 16,
                                            .blocks = 64,
                                            .window_blocks = 48});
}

// A small window with sinks: the sink blocks stay while the blocks after them are released.
TEST_P(WindowRegionTest, AWindowWithSinksEqualsAPoolKeepingEveryToken) {
  RunTwoSequences(SyntheticWeights(Layers({kW, kF, kW}, 20, 6), 5), {.a_chunks = {40, 23, 41, 17},
                                                                     .b_prompt = 13,
                                                                     .decodes = 12,
                                                                     .block_size = 4,
                                                                     .blocks = 64,
                                                                     .window_blocks = 40});
}

// Full, window and state-space layers over a pool with a window region and state slots.
TEST_P(WindowRegionTest, AMixedModelRunsWithAWindowRegionAndStateSlots) {
  const ModelWeights w = SyntheticWeights(Layers({kS, kW, kF, kS, kW}, 12, 2), 9);
  ASSERT_EQ(w.config.kv_layer(1, true), 1);  // the full layer first, then the sliding ones
  ASSERT_EQ(w.config.kv_layer(2, true), 0);
  ASSERT_EQ(w.config.kv_layer(4, true), 2);
  RunTwoSequences(w, {.a_chunks = {19, 14, 9},
                      .b_prompt = 11,
                      .decodes = 8,
                      .block_size = 4,
                      .blocks = 48,
                      .window_blocks = 24,
                      .state_slots = 2});
}

INSTANTIATE_TEST_SUITE_P(Backends, WindowRegionTest, kernels::test_util::AllBackends(),
                         kernels::test_util::BackendName());

// Pool layers with a window group: full layers first in model order, then sliding layers in
// model order; without one, every attention layer in model order (as before).
TEST(WindowRegionChecksTest, SlidingLayersAreThePoolsLastWithAWindowGroup) {
  const ModelConfig c = Layers({kS, kW, kF, kW, kS, kF}, 8, 0);
  EXPECT_EQ(c.num_sliding_layers(), 2);
  const int32_t with[] = {-1, 2, 0, 3, -1, 1}, without[] = {-1, 0, 1, 2, -1, 3};
  for (int32_t l = 0; l < c.num_layers; ++l) {
    if (c.kind(l) == kS) continue;
    EXPECT_EQ(c.kv_layer(l, true), with[l]) << l;
    EXPECT_EQ(c.kv_layer(l, false), without[l]) << l;
    EXPECT_EQ(c.kv_layer(l), without[l]) << l;
  }
  const ModelConfig swa = *NamedConfig("tiny-swa");  // sliding, full, sliding, full
  EXPECT_EQ(swa.kv_layer(0, true), 2);
  EXPECT_EQ(swa.kv_layer(1, true), 0);
  EXPECT_EQ(swa.kv_layer(2, true), 3);
  EXPECT_EQ(swa.kv_layer(3, true), 1);
}

TEST(WindowRegionChecksTest, AWindowGroupMustHoldExactlyTheSlidingLayers) {
  const ModelWeights w = SyntheticWeights(Layers({kW, kF, kW}, 8, 0), 1);
  kernels::PoolLayout l{.block_size = 4,
                        .num_layers = 3,
                        .num_kv_heads = 2,
                        .head_dim = 32,
                        .dtype = kernels::DType::kF32,
                        .num_blocks = 8,
                        .num_window_layers = 1,
                        .num_window_blocks = 4};
  absl::Status s = CheckModel(w, l);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("2 sliding-window layers"));
  l.num_window_layers = 2;
  EXPECT_TRUE(CheckModel(w, l).ok());
  const ModelWeights plain = SyntheticWeights(SmallTestConfig(), 1);
  l.num_layers = 2;
  l.num_window_layers = 1;
  EXPECT_EQ(CheckModel(plain, l).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Model::Create(plain, l, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

// Step refuses, before anything runs, a window table that lacks an entry the step writes or
// reads: the new tokens' blocks, the first query's window, the sinks. Nothing changes then.
TEST(WindowRegionChecksTest, StepRefusesAWindowTableMissingABlockItNeeds) {
  const ModelWeights w = SyntheticWeights(Layers({kW, kF}, 10, 3), 2);
  absl::StatusOr<kernels::Device*> cpu = kernels::test_util::Devices::Get("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  absl::StatusOr<Rig> made = MakeRig(*cpu, w, 4, 16, 12);
  ASSERT_TRUE(made.ok()) << made.status();
  Rig& rig = *made;
  // 20 tokens in: the next token (position 20) sees [11, 20] and the sinks [0, 3).
  Seq s{.tokens = RandomTokens(24, 256, 4)};
  s.table = {0, 1, 2, 3, 4, 5};
  s.window = {7, -1, 9, 2, 3, 4};  // block 1 ([4, 8)) is before the window
  for (int64_t b = 0; b < 5; ++b) {
    std::vector<ItemResult> out;
    const std::vector<int32_t> window = {7, 8, 9, 2, 3};
    const StepItem fill{.tokens = std::span(s.tokens).subspan(static_cast<size_t>(4 * b), 4),
                        .start = 4 * b,
                        .block_table = s.table,
                        .window_table = window};
    ASSERT_TRUE(rig.model->Step(rig.view, std::vector{fill}, {}, &out).ok());
  }
  const auto step = [&](std::vector<int32_t> window, int64_t tokens) {
    std::vector<ItemResult> out;
    const StepItem item{.tokens = std::span(s.tokens).subspan(20, static_cast<size_t>(tokens)),
                        .start = 20,
                        .block_table = s.table,
                        .window_table = window};
    return rig.model->Step(rig.view, std::vector{item}, {}, &out);
  };
  const std::vector<char> before = rig.Bytes();
  const auto refused = [&](std::vector<int32_t> window, int64_t tokens, const char* what) {
    const absl::Status st = step(window, tokens);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << what << ": " << st;
    EXPECT_TRUE(rig.Bytes() == before) << what;
    return std::string(st.message());
  };
  EXPECT_THAT(refused({7, -1, 9, 2, 3, -1}, 1, "the new token's block"),
              HasSubstr("window table entry 5 is block -1"));
  EXPECT_THAT(refused({7, -1, -1, 2, 3, 4}, 1, "the window's first block"),
              HasSubstr("window table entry 2 is block -1"));
  EXPECT_THAT(refused({-1, -1, 9, 2, 3, 4}, 1, "the sinks"),
              HasSubstr("window table entry 0 is block -1"));
  EXPECT_THAT(refused({7, -1, 9, 2, 12, 4}, 1, "past the window region"),
              HasSubstr("entry 4 is block 12 (the window group has 12)"));
  EXPECT_THAT(refused({7, -1, 9, 2, 3}, 4, "a table too short"), HasSubstr("window table has 5"));
  EXPECT_THAT(refused({}, 1, "no window table"), HasSubstr("window table has 0"));
  // The entries before the window are not looked at: the same step runs.
  EXPECT_TRUE(step({7, -1, 9, 2, 3, 4}, 1).ok());
  EXPECT_TRUE(rig.Bytes() != before);
}

}  // namespace
}  // namespace kvpool::model

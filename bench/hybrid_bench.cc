// tiny-hybrid (state-space layers, issue 28) beside tiny, in process (model::LocalEngine on the
// CPU backend), in the same run:
//
//   build/release/bench/hybrid_bench --benchmark_repetitions=3
//
// - BM_Prefill/model:M: one prefill of kPrefillTokens fresh tokens (a new sequence, freed outside
//   the timing); tokens/s. M 0 is tiny, 1 tiny-hybrid. No prefix cache on either side (a hybrid
//   model has none until checkpoints exist).
// - BM_Decode/model:M/batch:B: one decode step of B sequences; each starts from a 64-token
//   prompt and starts over (outside the timing) at kRestartAt tokens; tokens/s.
// - BM_PrefillCheckpoints/every:E: tiny-hybrid's model step (model::Model, no engine) over one
//   prefill of kPrefillTokens tokens from a zero state, taking a state checkpoint every E tokens
//   (StepItem::checkpoints; E 0: none), so the step runs in kPrefillTokens / E phases; tokens/s.
// All: synthetic weights of seed 1, blocks of 16, bf16 KV.
//
// Before the benchmarks it prints the memory one sequence of 32k tokens takes, computed from the
// pool layouts and ModelConfig::state_bytes(): tiny's KV; tiny-hybrid's state plus the KV of its
// attention layers (what a pool with a state group holds, docs/hybrid-groups.md §2), and, apart,
// what today's pool holds for it (a KV chunk for every layer, the state layers' unused).

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "bench/ratio_reporter.h"
#include "benchmark/benchmark.h"
#include "kvpool/util/check.h"
#include "model/local_engine.h"
#include "model/model.h"
#include "model/weights.h"

namespace kvpool {
namespace {

constexpr const char* kModels[] = {"tiny", "tiny-hybrid"};
constexpr int64_t kPrefillTokens = 512;
constexpr size_t kPromptTokens = 64;
constexpr int64_t kRestartAt = 512;
constexpr int64_t kContext = 32768;  // tokens of the memory comparison

std::vector<int32_t> Tokens(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> out(n);
  for (int32_t& t : out) t = static_cast<int32_t>(rng() % 8192);  // tiny's vocabulary
  return out;
}

std::unique_ptr<model::LocalEngine> Engine(int m) {
  auto engine = model::LocalEngine::Create(
      model::SyntheticWeights(*model::NamedConfig(kModels[m]), 1),
      {.block_size = 16, .pool_bytes = int64_t{64} << 20, .prefix_cache = false});
  KVPOOL_CHECK_OK(engine.status());
  return std::move(engine).value();
}

void BM_Prefill(benchmark::State& state) {
  auto engine = Engine(static_cast<int>(state.range(0)));
  uint32_t seed = 1;
  for (auto _ : state) {
    const std::vector<int32_t> prompt = Tokens(kPrefillTokens, seed++);
    auto out = engine->Prefill(SequenceId(0), prompt);
    KVPOOL_CHECK_OK(out.status());
    state.PauseTiming();
    KVPOOL_CHECK_OK(engine->Free(out->sequence, false));
    state.ResumeTiming();
  }
  state.counters["tokens/s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * kPrefillTokens), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Prefill)
    ->ArgName("model")
    ->Arg(0)
    ->Arg(1)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

void BM_Decode(benchmark::State& state) {
  auto engine = Engine(static_cast<int>(state.range(0)));
  const auto batch = static_cast<size_t>(state.range(1));
  std::vector<model::DecodeInput> inputs(batch);
  int64_t length = 0;
  const auto restart = [&] {
    for (size_t i = 0; i < batch; ++i) {
      if (inputs[i].sequence != SequenceId(0)) {
        KVPOOL_CHECK_OK(engine->Free(inputs[i].sequence, false));
      }
      auto out = engine->Prefill(SequenceId(0), Tokens(kPromptTokens, static_cast<uint32_t>(i)));
      KVPOOL_CHECK_OK(out.status());
      inputs[i] = {out->sequence, out->result.next_token};
    }
    length = static_cast<int64_t>(kPromptTokens);
  };
  restart();
  for (auto _ : state) {
    if (length >= kRestartAt) {
      state.PauseTiming();
      restart();
      state.ResumeTiming();
    }
    auto out = engine->Decode(inputs);
    KVPOOL_CHECK_OK(out.status());
    for (size_t i = 0; i < batch; ++i) inputs[i].token = (*out)[i].next_token;
    ++length;
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * static_cast<int64_t>(batch)),
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Decode)
    ->ArgNames({"model", "batch"})
    ->ArgsProduct({{0, 1}, {1, 8}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

void BM_PrefillCheckpoints(benchmark::State& state) {
  const model::ModelConfig c = *model::NamedConfig("tiny-hybrid");
  const auto blocks = static_cast<int32_t>(kPrefillTokens / 16);
  const kernels::PoolLayout layout{.block_size = 16,
                                   .num_layers = c.pool_layers(),
                                   .num_kv_heads = c.num_kv_heads,
                                   .head_dim = c.head_dim,
                                   .num_blocks = blocks};
  auto model = model::Model::Create(model::SyntheticWeights(c, 1), layout, {});
  KVPOOL_CHECK_OK(model.status());
  const auto bytes = static_cast<size_t>((layout.arena_bytes() + 4095) / 4096 * 4096);
  std::unique_ptr<void, decltype(&std::free)> arena(std::aligned_alloc(4096, bytes), &std::free);
  const kernels::KvPoolView pool{arena.get(), layout};
  std::vector<int32_t> table(static_cast<size_t>(blocks));
  std::iota(table.begin(), table.end(), 0);
  const auto floats = static_cast<size_t>(c.state_bytes() / 4);
  std::vector<float> live(floats);
  const int64_t every = state.range(0);
  const size_t count = every == 0 ? 0 : static_cast<size_t>(kPrefillTokens / every);
  std::vector<std::vector<float>> copies(count, std::vector<float>(floats));
  std::vector<model::StateCheckpoint> checkpoints;
  for (size_t k = 0; k < count; ++k) {
    checkpoints.push_back({static_cast<int64_t>(k + 1) * every, copies[k]});
  }
  uint32_t seed = 1;
  std::vector<model::ItemResult> results;
  for (auto _ : state) {
    state.PauseTiming();
    const std::vector<int32_t> prompt = Tokens(kPrefillTokens, seed++);
    std::fill(live.begin(), live.end(), 0.0f);
    state.ResumeTiming();
    const model::StepItem item{
        .tokens = prompt, .block_table = table, .state = live, .checkpoints = checkpoints};
    KVPOOL_CHECK_OK((*model)->Step(pool, std::span(&item, 1), {}, &results));
  }
  state.counters["tokens/s"] = benchmark::Counter(
      static_cast<double>(state.iterations() * kPrefillTokens), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_PrefillCheckpoints)
    ->ArgName("every")
    ->Arg(0)
    ->Arg(512)
    ->Arg(128)
    ->Arg(64)
    ->Arg(16)
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// Bytes of one sequence of kContext tokens: KV of the layers `counted` keeps, plus its state.
void PrintMemory() {
  std::printf("memory per sequence at %lld tokens (bf16 KV, blocks of 16):\n",
              static_cast<long long>(kContext));
  double tiny_bytes = 0;
  for (int m = 0; m < 2; ++m) {
    auto engine = Engine(m);
    const kernels::PoolLayout& layout = engine->pool().layout;
    const model::ModelConfig& c = engine->model().config();
    const int64_t blocks = (kContext + layout.block_size - 1) / layout.block_size;
    // The pool holds K/V of the attention layers only (ModelConfig::pool_layers()).
    const int64_t kv = blocks * layout.block_bytes(), state = c.state_bytes();
    const double total = static_cast<double>(kv + state);
    if (m == 0) tiny_bytes = total;
    std::printf(
        "  %-12s KV %8.2f MiB (%d of %d layers) + state %6.3f MiB = %8.2f MiB  (%.2fx tiny)\n",
        kModels[m], static_cast<double>(kv) / (1 << 20), layout.num_layers, c.num_layers,
        static_cast<double>(state) / (1 << 20), total / (1 << 20), total / tiny_bytes);
    if (c.num_state_layers() > 0) {
      const int64_t every_layer = blocks * layout.block_bytes() / layout.num_layers * c.num_layers;
      std::printf(
          "  %-12s a pool with a KV chunk for every layer (before the state group) + "
          "state: %.2f MiB\n",
          "", static_cast<double>(every_layer + state) / (1 << 20));
    }
  }
  // tiny-swa: its full layers' blocks for every token, and in the window group at most
  // WindowBound() window blocks once each step has slid its window (docs/hybrid-groups.md §3),
  // against the same model keeping every token of every layer (no window group).
  for (const int32_t window_blocks : {0, -1}) {
    auto swa = model::LocalEngine::Create(
        model::SyntheticWeights(*model::NamedConfig("tiny-swa"), 1),
        {.block_size = 16, .pool_bytes = int64_t{64} << 20, .window_blocks = window_blocks});
    KVPOOL_CHECK_OK(swa.status());
    const kernels::PoolLayout& layout = (*swa)->pool().layout;
    const int64_t blocks = (kContext + layout.block_size - 1) / layout.block_size;
    const int64_t kv =
        blocks * layout.block_bytes() + (*swa)->cache().WindowBound() * layout.window_block_bytes();
    std::printf("  %-12s KV %8.2f MiB (%s)  (%.2fx tiny)\n", "tiny-swa",
                static_cast<double>(kv) / (1 << 20),
                window_blocks == 0 ? "window group: the window's blocks only"
                                   : "every token of every layer",
                static_cast<double>(kv) / tiny_bytes);
  }
}

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  kvpool::PrintMemory();
  return kvpool::bench::RunWithRatios(
      argc, argv,
      {{"prefill 512: tiny-hybrid vs tiny", "BM_Prefill/model:1/real_time",
        "BM_Prefill/model:0/real_time", 0},
       {"decode batch 1: tiny-hybrid vs tiny", "BM_Decode/model:1/batch:1/real_time",
        "BM_Decode/model:0/batch:1/real_time", 0},
       {"decode batch 8: tiny-hybrid vs tiny", "BM_Decode/model:1/batch:8/real_time",
        "BM_Decode/model:0/batch:8/real_time", 0},
       {"prefill 512, one checkpoint at the end vs none",
        "BM_PrefillCheckpoints/every:512/real_time", "BM_PrefillCheckpoints/every:0/real_time", 0},
       {"prefill 512, a checkpoint every 128 tokens vs none",
        "BM_PrefillCheckpoints/every:128/real_time", "BM_PrefillCheckpoints/every:0/real_time", 0},
       {"prefill 512, a checkpoint every 64 tokens vs none",
        "BM_PrefillCheckpoints/every:64/real_time", "BM_PrefillCheckpoints/every:0/real_time", 0},
       {"prefill 512, a checkpoint every 16 tokens vs none",
        "BM_PrefillCheckpoints/every:16/real_time", "BM_PrefillCheckpoints/every:0/real_time", 0}});
}

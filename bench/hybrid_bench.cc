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
// Both: synthetic weights of seed 1, blocks of 16, bf16 KV.
//
// Before the benchmarks it prints the memory one sequence of 32k tokens takes, computed from the
// pool layouts and ModelConfig::state_bytes(): tiny's KV; tiny-hybrid's state plus the KV of its
// attention layers (what a pool with a state group holds, docs/hybrid-groups.md §2), and, apart,
// what today's pool holds for it (a KV chunk for every layer, the state layers' unused).

#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "bench/ratio_reporter.h"
#include "benchmark/benchmark.h"
#include "kvpool/util/check.h"
#include "model/local_engine.h"
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
        "BM_Decode/model:0/batch:8/real_time", 0}});
}

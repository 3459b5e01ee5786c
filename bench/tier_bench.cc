// Host tier promotion bandwidth: kvpoold's engine promoting a 64-block prefix from the host tier
// into fresh device blocks (host tier lookup into staging buffers, the copy into the pool on the
// transfer stream, its fence, the publish), beside a bare memcpy of the same bytes, in one run.
//
//   build/release/bench/tier_bench --benchmark_repetitions=5
//
// The CPU backend: the "device" is host memory, so a promotion is two copies (tier slot ->
// staging buffer -> pool block) plus the bookkeeping; the ratio says what share of memcpy
// bandwidth a promotion reaches (0.5 would be two copies at memcpy speed). Blocks are the tiny
// model's shape, 64 KiB (16 tokens x 4 layers x 4 KV heads x 64 dims x K,V x bf16); 64 of them, 4
// MiB, are a 1,024-token prefix.

#include <cstring>
#include <memory>
#include <vector>

#include "bench/ratio_reporter.h"
#include "benchmark/benchmark.h"
#include "daemon/engine/engine.h"
#include "kernels/cpu_device.h"
#include "kvpool/util/check.h"

namespace kvpool::daemon {
namespace {

constexpr int kPrefixBlocks = 64;

kernels::PoolLayout Layout() {
  return {.block_size = 16,
          .num_layers = 4,
          .num_kv_heads = 4,
          .head_dim = 64,
          .dtype = kernels::DType::kBF16,
          .num_blocks = 4 * kPrefixBlocks};
}

std::vector<int32_t> Prompt() {
  std::vector<int32_t> tokens(kPrefixBlocks * 16);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % 32000);
  return tokens;
}

void BM_PromoteFromHost(benchmark::State& state) {
  kernels::CpuDevice device(1);
  EngineOptions options;
  options.pools = {{.name = "default", .layout = Layout()}};
  options.tiers.host_blocks = 2 * kPrefixBlocks;
  auto engine = std::move(*Engine::Create(options, &device, /*model=*/nullptr));
  auto session = *engine->OpenSession(
      {.client_name = "bench", .tenant = "t", .model = "m", .kv_access = true});
  const std::vector<int32_t> prompt = Prompt();
  const AllocateRequest request{.num_tokens = static_cast<int64_t>(prompt.size()),
                                .prompt = prompt};
  // Publish the prefix once; the host tier has it from then on.
  Tables t = *engine->Allocate(*session, std::span(&request, 1), CallContext::Uncancellable());
  SequenceId id = t.slices[0].sequence;
  KVPOOL_CHECK_OK(
      engine->Free(*session, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable()));
  KVPOOL_CHECK_OK(engine->FlushTiers(absl::Seconds(10)));
  for (auto _ : state) {
    state.PauseTiming();
    KVPOOL_CHECK(engine->Evict(0, 0, /*all=*/true).ok());
    state.ResumeTiming();
    t = *engine->Allocate(*session, std::span(&request, 1), CallContext::Uncancellable());
    state.PauseTiming();
    KVPOOL_CHECK(t.slices[0].matched_tokens == static_cast<int64_t>(prompt.size()));
    id = t.slices[0].sequence;
    KVPOOL_CHECK_OK(
        engine->Free(*session, std::span(&id, 1), OnFree::kDiscard, CallContext::Uncancellable()));
    state.ResumeTiming();
  }
  const TierStats tiers = engine->Stats().tiers;
  KVPOOL_CHECK(tiers.promoted_from_host >=
               static_cast<uint64_t>(state.iterations()) * kPrefixBlocks);
  state.SetBytesProcessed(state.iterations() * kPrefixBlocks * Layout().block_bytes());
}
BENCHMARK(BM_PromoteFromHost)->UseRealTime();

// memcpy of the same 4 MiB per iteration, from and to memory the caches do not hold (16 pairs
// of regions in turn, 128 MiB), as the promotion's tier slots and pool blocks are.
void BM_Memcpy(benchmark::State& state) {
  constexpr int kRegions = 16;
  const size_t bytes = static_cast<size_t>(kPrefixBlocks * Layout().block_bytes());
  std::vector<std::byte> src(bytes * kRegions, std::byte{1});
  std::vector<std::byte> dst(bytes * kRegions, std::byte{2});
  int region = 0;
  for (auto _ : state) {
    std::memcpy(dst.data() + region * bytes, src.data() + region * bytes, bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
    region = (region + 1) % kRegions;
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
}
BENCHMARK(BM_Memcpy)->UseRealTime();

}  // namespace
}  // namespace kvpool::daemon

int main(int argc, char** argv) {
  return kvpool::bench::RunWithRatios(
      argc, argv,
      {{"promote 64 x 64 KiB from the host tier / memcpy of 4 MiB", "BM_PromoteFromHost/real_time",
        "BM_Memcpy/real_time", 0, kvpool::bench::RatioPair::Compare::kBandwidth}});
}

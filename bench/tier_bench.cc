// Host tier promotion bandwidth: kvpoold's engine promoting a 64-block prefix from the host tier
// into fresh device blocks (the host tier lookup, the copy into the pool on the transfer stream,
// its fence, the publish), beside a bare memcpy of the same bytes, in one run: each on its own,
// and both alternately, call by call (BM_PromoteVsMemcpy, the judged ratio).
//
//   build/release/bench/tier_bench --benchmark_repetitions=5
//
// The CPU backend: the "device" is host memory, so a promotion is one copy (tier slot -> pool
// block, issue 31; two before, through a staging buffer) plus the bookkeeping; the ratio says
// what share of memcpy bandwidth a promotion reaches. Blocks are the tiny model's shape, 64 KiB
// (16 tokens x 4 layers x 4 KV heads x 64 dims x K,V x bf16); 64 of them, 4 MiB, are a
// 1,024-token prefix.
//
// The CPU device copies with streaming stores (kernels/internal/stream_copy.h), which beat glibc's
// memcpy at these sizes; so the promotion is also set against that same copy of the same bytes
// (BM_PromoteVsStreamCopy): the bookkeeping's cost over the fastest bare copy here.
// BM_StreamCopyVsMemcpy compares the two copies alone, at a 4 MiB run and at one 64 KiB block.
//
// Both sides see the same caches: the promotion takes kPrefixes prefixes in turn (64 MiB of tier
// slots, twice the L3 of the machines this runs on), and the pool's free list hands it the same 64
// blocks each time; the memcpy reads kPrefixes source regions in turn into one destination.

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "bench/ratio_reporter.h"
#include "benchmark/benchmark.h"
#include "daemon/engine/engine.h"
#include "kernels/cpu_device.h"
#include "kernels/internal/stream_copy.h"
#include "kvpool/util/check.h"

namespace kvpool::daemon {
namespace {

constexpr int kPrefixBlocks = 64;
constexpr int kPrefixes = 16;

kernels::PoolLayout Layout() {
  return {.block_size = 16,
          .num_layers = 4,
          .num_kv_heads = 4,
          .head_dim = 64,
          .dtype = kernels::DType::kBF16,
          .num_blocks = 2 * kPrefixBlocks};
}

std::vector<int32_t> Prompt(int prefix) {
  std::vector<int32_t> tokens(kPrefixBlocks * 16);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>((i * 7919 + static_cast<size_t>(prefix) * 104729) % 32000);
  }
  return tokens;
}

// An engine whose host tier holds kPrefixes prefixes, none of them in the pool.
struct Promoter {
  kernels::CpuDevice device{1};
  std::unique_ptr<Engine> engine;
  std::shared_ptr<const Session> session;
  std::vector<std::vector<int32_t>> prompts;
  int next = 0;

  Promoter() {
    EngineOptions options;
    options.pools = {{.name = "default", .layout = Layout()}};
    options.tiers.host_blocks = kPrefixes * kPrefixBlocks;
    engine = std::move(*Engine::Create(options, &device, /*model=*/nullptr));
    session = *engine->OpenSession(
        {.client_name = "bench", .tenant = "t", .model = "m", .kv_access = true});
    for (int p = 0; p < kPrefixes; ++p) {
      prompts.push_back(Prompt(p));
      const SequenceId id = Allocate(prompts.back()).slices[0].sequence;
      KVPOOL_CHECK_OK(
          engine->Free(*session, std::span(&id, 1), OnFree::kCommit, CallContext::Uncancellable()));
      KVPOOL_CHECK_OK(engine->FlushTiers(absl::Seconds(10)));
      KVPOOL_CHECK(engine->Evict(0, 0, /*all=*/true).ok());
    }
  }
  Tables Allocate(std::span<const int32_t> prompt) {
    const AllocateRequest request{.num_tokens = static_cast<int64_t>(prompt.size()),
                                  .prompt = prompt};
    return *engine->Allocate(*session, std::span(&request, 1), CallContext::Uncancellable());
  }
  // Promotes the next prefix (timed by the caller) and returns its sequence.
  SequenceId Promote() {
    const std::vector<int32_t>& prompt = prompts[static_cast<size_t>(next)];
    next = (next + 1) % kPrefixes;
    const Tables t = Allocate(prompt);
    KVPOOL_CHECK(t.slices[0].matched_tokens == static_cast<int64_t>(prompt.size()));
    return t.slices[0].sequence;
  }
  // Untimed: frees it and empties the pool again.
  void Reset(SequenceId id) {
    KVPOOL_CHECK_OK(
        engine->Free(*session, std::span(&id, 1), OnFree::kDiscard, CallContext::Uncancellable()));
    KVPOOL_CHECK(engine->Evict(0, 0, /*all=*/true).ok());
  }
  void CheckPromoted(int64_t iterations) const {
    KVPOOL_CHECK(engine->Stats().tiers.promoted_from_host >=
                 static_cast<uint64_t>(iterations) * kPrefixBlocks);
  }
};

// A copy of one prefix's bytes (or `bytes` of them) from kPrefixes source regions in turn into
// one destination: memcpy, or the CPU device's streaming copy.
struct Copier {
  explicit Copier(bool streaming = false,
                  size_t bytes = static_cast<size_t>(kPrefixBlocks * Layout().block_bytes()))
      : streaming(streaming), bytes(bytes) {}
  const bool streaming;
  const size_t bytes;
  // At least kPrefixes regions and 64 MiB: the source comes from DRAM, as a tier slot's does.
  const size_t regions = std::max<size_t>(kPrefixes, (size_t{64} << 20) / bytes);
  std::vector<std::byte> src = std::vector<std::byte>(bytes * regions, std::byte{1});
  std::vector<std::byte> dst = std::vector<std::byte>(bytes, std::byte{2});
  size_t region = 0;

  void Copy() {
    const std::byte* from = src.data() + region * bytes;
    if (streaming) {
      kernels::internal::StreamCopy(dst.data(), from, bytes);
    } else {
      std::memcpy(dst.data(), from, bytes);
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
    region = (region + 1) % regions;
  }
};

void BM_PromoteFromHost(benchmark::State& state) {
  Promoter promoter;
  for (auto _ : state) {
    const SequenceId id = promoter.Promote();
    state.PauseTiming();
    promoter.Reset(id);
    state.ResumeTiming();
  }
  promoter.CheckPromoted(state.iterations());
  state.SetBytesProcessed(state.iterations() * kPrefixBlocks * Layout().block_bytes());
}
BENCHMARK(BM_PromoteFromHost)->UseRealTime();

void BM_Memcpy(benchmark::State& state) {
  Copier copier;
  for (auto _ : state) copier.Copy();
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(copier.bytes));
}
BENCHMARK(BM_Memcpy)->UseRealTime();

// A promotion and a copy of the same bytes alternately, call by call (bench::Interleave), each
// promotion's reset untimed: both sides of the ratio see the same machine.
void PromoteVsCopy(benchmark::State& state, bool streaming, const char* copy_counter) {
  Promoter promoter;
  Copier copier(streaming);
  std::optional<SequenceId> promoted;
  bench::Interleave(
      state, [&] { promoted = promoter.Promote(); }, "promote_ns", [&] { copier.Copy(); },
      copy_counter,
      [&] {
        if (promoted.has_value()) promoter.Reset(*promoted);
        promoted.reset();
      });
  promoter.CheckPromoted(state.iterations());
}
void BM_PromoteVsMemcpy(benchmark::State& state) { PromoteVsCopy(state, false, "memcpy_ns"); }
BENCHMARK(BM_PromoteVsMemcpy)->UseRealTime();
void BM_PromoteVsStreamCopy(benchmark::State& state) { PromoteVsCopy(state, true, "copy_ns"); }
BENCHMARK(BM_PromoteVsStreamCopy)->UseRealTime();

// The two copies alone, interleaved, at a promoted run (4 MiB) and at one block (64 KiB).
void BM_StreamCopyVsMemcpy(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  Copier streaming(/*streaming=*/true, bytes);
  Copier plain(/*streaming=*/false, bytes);
  bench::Interleave(
      state, [&] { streaming.Copy(); }, "stream_ns", [&] { plain.Copy(); }, "memcpy_ns");
}
BENCHMARK(BM_StreamCopyVsMemcpy)
    ->Arg(kPrefixBlocks* Layout().block_bytes())
    ->Arg(Layout().block_bytes())
    ->UseRealTime();

}  // namespace
}  // namespace kvpool::daemon

int main(int argc, char** argv) {
  return kvpool::bench::RunWithRatios(
      argc, argv,
      {
          {"promote 64 x 64 KiB from the host tier / memcpy of 4 MiB",
           "BM_PromoteFromHost/real_time", "BM_Memcpy/real_time", 0,
           kvpool::bench::RatioPair::Compare::kBandwidth},
          {.label = "promote / memcpy, interleaved",
           .ours = "BM_PromoteVsMemcpy/real_time",
           .baseline = "BM_PromoteVsMemcpy/real_time",
           .target = 0.9,
           .ours_counter = "promote_ns",
           .baseline_counter = "memcpy_ns"},
          {.label = "promote / the same streaming copy, interleaved",
           .ours = "BM_PromoteVsStreamCopy/real_time",
           .baseline = "BM_PromoteVsStreamCopy/real_time",
           .ours_counter = "promote_ns",
           .baseline_counter = "copy_ns"},
          {.label = "streaming copy / memcpy, 4 MiB, interleaved",
           .ours = "BM_StreamCopyVsMemcpy/4194304/real_time",
           .baseline = "BM_StreamCopyVsMemcpy/4194304/real_time",
           .ours_counter = "stream_ns",
           .baseline_counter = "memcpy_ns"},
          {.label = "streaming copy / memcpy, 64 KiB, interleaved",
           .ours = "BM_StreamCopyVsMemcpy/65536/real_time",
           .baseline = "BM_StreamCopyVsMemcpy/65536/real_time",
           .ours_counter = "stream_ns",
           .baseline_counter = "memcpy_ns"},
      });
}

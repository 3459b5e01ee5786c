// Disk tier throughput and restart time (docs/tiers.md), on the file system of a directory the
// caller names, in one run:
//
//   KVPOOL_DISK_BENCH_DIR=/var/tmp/kvpool-disk-bench KVPOOL_DISK_BENCH_MIB=1024
//   build/release/bench/disk_tier_bench --benchmark_repetitions=3   (with those two exported)
//
// - BM_PromoteFromDisk: the tier's lookups of every stored chain (64 blocks of 64 KiB, a
//   1,024-token prefix of the tiny model, each; read with O_DIRECT in runs of adjacent slots into
//   page-aligned buffers, each record's Poly1305 tag verified), over the whole tier.
// - BM_DdSameBytes: `dd iflag=direct bs=4M` of the same data file to /dev/null: the file system's
//   own sequential read of the same bytes. The ratio is the target (>= 0.8).
// - BM_RestartToFirstHit: what a restart costs before the first hit: Open (the index read and
//   rebuilt) and one chain's lookup.
//
// The tier is written once per process (KVPOOL_DISK_BENCH_MIB of records, default 64: the smoke
// run) and left in the directory for the next run to reuse only if the sizes agree.

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "bench/ratio_reporter.h"
#include "benchmark/benchmark.h"
#include "kvpool/prefix_cache.h"
#include "kvpool/util/check.h"
#include "tier/disk_block_store.h"

namespace kvpool::tier {
namespace {

constexpr int64_t kBlockBytes = 64 << 10;
constexpr int kChainBlocks = 64;
constexpr uint64_t kLayout = 0x7e57;
const BlockSpace kSpace{NamespaceId(1), kLayout};

std::string Env(const char* name, const char* otherwise) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : otherwise;
}

struct Tier {
  DiskTierOptions options;
  DeploymentSecret secret = DeploymentSecret::FromBytes(std::string(32, 'b'));
  std::vector<std::vector<BlockHash>> chains;
  std::unique_ptr<DiskBlockStore> store;
  std::vector<internal::AlignedBuffer> buffers;  // one chain's
  std::vector<std::span<std::byte>> spans;

  Tier() {
    const int64_t mib = std::stoll(Env("KVPOOL_DISK_BENCH_MIB", "64"));
    options.directory = Env("KVPOOL_DISK_BENCH_DIR", "/var/tmp/kvpool-disk-bench");
    options.capacity_bytes = mib << 20;
    options.write_queue_blocks = 4 * kChainBlocks;
    const int64_t n_chains = options.capacity_bytes / (kChainBlocks * kBlockBytes);
    std::vector<std::byte> bytes(kBlockBytes);
    for (int64_t c = 0; c < n_chains; ++c) {
      BlockHash parent;
      chains.emplace_back();
      for (int b = 0; b < kChainBlocks; ++b) {
        const int32_t tokens[1] = {static_cast<int32_t>(c * kChainBlocks + b)};
        parent = PrefixChainHash(parent, kSpace.ns, tokens);
        chains.back().push_back(parent);
      }
    }
    Open();
    if (store->disk_stats().blocks < n_chains * kChainBlocks) Fill(bytes);
    for (int b = 0; b < kChainBlocks; ++b) {
      buffers.push_back(*internal::AlignedBuffer::Create(kBlockBytes));
      spans.push_back(buffers.back().span());
    }
  }
  void Open() {
    store.reset();
    store = *DiskBlockStore::Open(options, secret, kLayout, kBlockBytes);
  }
  void Fill(std::vector<std::byte>& bytes) {
    for (const std::vector<BlockHash>& chain : chains) {
      for (size_t b = 0; b < chain.size(); ++b) {
        for (size_t i = 0; i < bytes.size(); i += 64) bytes[i] = std::byte(b + i);
        while (!store->Put(kSpace, {.hash = chain[b],
                                    .parent = b == 0 ? BlockHash{} : chain[b - 1],
                                    .coverage = 16,
                                    .bytes = bytes})) {
          KVPOOL_CHECK_OK(store->Flush(absl::Seconds(60)));  // the queue was full: let it drain
        }
      }
    }
    KVPOOL_CHECK_OK(store->Flush(absl::Seconds(600)));
  }
  int64_t LookupChain(size_t c) {
    return store->Lookup(kSpace, BlockHash{}, chains[c], spans)->hits;
  }
  std::string DataFile() const { return options.directory + "/blocks.kvd"; }
};

Tier& TheTier() {
  static Tier* tier = new Tier();
  return *tier;
}

void BM_PromoteFromDisk(benchmark::State& state) {
  Tier& tier = TheTier();
  int64_t blocks = 0;
  for (auto _ : state) {
    for (size_t c = 0; c < tier.chains.size(); ++c) blocks += tier.LookupChain(c);
  }
  KVPOOL_CHECK(blocks ==
               static_cast<int64_t>(state.iterations() * tier.chains.size() * kChainBlocks));
  state.SetBytesProcessed(blocks * kBlockBytes);
  state.counters["direct_io"] = tier.store->disk_stats().direct_io ? 1 : 0;
}
BENCHMARK(BM_PromoteFromDisk)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_DdSameBytes(benchmark::State& state) {
  Tier& tier = TheTier();
  const int64_t bytes = static_cast<int64_t>(tier.chains.size()) * kChainBlocks * kBlockBytes;
  const std::string command =
      "dd if=" + tier.DataFile() +
      " of=/dev/null bs=4M iflag=direct count=" + std::to_string(bytes >> 22) + " status=none";
  for (auto _ : state) KVPOOL_CHECK(std::system(command.c_str()) == 0);
  state.SetBytesProcessed(state.iterations() * bytes);
}
BENCHMARK(BM_DdSameBytes)->UseRealTime()->Unit(benchmark::kMillisecond);

void BM_RestartToFirstHit(benchmark::State& state) {
  Tier& tier = TheTier();
  for (auto _ : state) {
    tier.Open();
    KVPOOL_CHECK(tier.LookupChain(tier.chains.size() / 2) == kChainBlocks);
  }
  state.counters["records"] = static_cast<double>(tier.store->disk_stats().recovered_blocks);
  state.counters["tier_GiB"] =
      static_cast<double>(tier.store->disk_stats().recovered_blocks * kBlockBytes) / (1 << 30);
}
BENCHMARK(BM_RestartToFirstHit)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvpool::tier

int main(int argc, char** argv) {
  return kvpool::bench::RunWithRatios(
      argc, argv,
      {{"disk tier lookups (64 x 64 KiB chains, MAC checked) / dd iflag=direct bs=4M, same file",
        "BM_PromoteFromDisk/real_time", "BM_DdSameBytes/real_time", 0.8,
        kvpool::bench::RatioPair::Compare::kBandwidth}});
}

// Core bookkeeping costs beside bare std::vector<int32_t> work measured in the same run.
//
//   build/release/bench/core_bench --benchmark_repetitions=5
//
// Each kvpool benchmark has a baseline doing the same job with no bookkeeping: a free list as a
// bare vector stack, tables as bare vectors. The block trace stays on (depth 8), as in production.

#include <utility>
#include <vector>

#include "bench/ratio_reporter.h"
#include "benchmark/benchmark.h"
#include "kvpool/block_pool.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/check.h"

namespace kvpool {
namespace {

constexpr int32_t kBlockSize = 16;
constexpr int32_t kNumBlocks = 1 << 16;
constexpr int kSequences = 256;
constexpr int64_t kMaxTokens = 1024;  // sequences grow to this, then rewind to 0

std::unique_ptr<KvCacheManager> MakeCache() {
  auto cache = KvCacheManager::Create({.block_size = kBlockSize,
                                       .num_blocks = kNumBlocks,
                                       .max_blocks_per_seq = kMaxTokens / kBlockSize});
  KVPOOL_CHECK_OK(cache.status());
  return std::move(*cache);
}

// --- allocate + free of one block -------------------------------------------------------------

void BM_PoolAllocateFree(benchmark::State& state) {
  auto pool = BlockPool::Create({.num_blocks = 1024});
  KVPOOL_CHECK_OK(pool.status());
  const NamespaceSlot ns = *(*pool)->RegisterNamespace(NamespaceId(1));
  // One clock reading per API call is the manager's job; the pool records what it is given.
  const TraceContext ctx{.session = SessionId(1), .sequence = SequenceId(1), .time_ns = 42};
  std::vector<BlockId> out;
  std::vector<BlockFill> fills;
  out.reserve(1);
  fills.reserve(1);
  for (auto _ : state) {
    out.clear();
    fills.clear();
    (void)(*pool)->Allocate(1, ns, ctx, &out, &fills);
    benchmark::DoNotOptimize(out.data());
    (void)(*pool)->Release(out[0], ctx);
  }
  KVPOOL_CHECK_OK((*pool)->CheckInvariants());
}
BENCHMARK(BM_PoolAllocateFree);

// The same job with nothing but two vectors: pop an id off a free stack onto a table, then back.
void BM_VectorPushPop(benchmark::State& state) {
  std::vector<int32_t> free_list;
  for (int32_t b = 1023; b >= 0; --b) free_list.push_back(b);
  std::vector<int32_t> table;
  table.reserve(1);
  for (auto _ : state) {
    table.push_back(free_list.back());
    free_list.pop_back();
    benchmark::DoNotOptimize(table.data());
    free_list.push_back(table.back());
    table.pop_back();
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_VectorPushPop);

// Steady state: 512 blocks held in FIFO order, each iteration allocates one and frees the oldest,
// so consecutive operations touch different blocks (as a busy pool does) instead of re-handing
// the same one.
constexpr int kHeld = 512;

void BM_PoolAllocateFreeSteady(benchmark::State& state) {
  auto pool = BlockPool::Create({.num_blocks = 1024});
  KVPOOL_CHECK_OK(pool.status());
  const NamespaceSlot ns = *(*pool)->RegisterNamespace(NamespaceId(1));
  const TraceContext ctx{.session = SessionId(1), .sequence = SequenceId(1), .time_ns = 42};
  std::vector<BlockId> ring;
  std::vector<BlockFill> fills;
  KVPOOL_CHECK_OK((*pool)->Allocate(kHeld, ns, ctx, &ring, &fills));
  std::vector<BlockId> out;
  out.reserve(1);
  size_t head = 0;
  for (auto _ : state) {
    out.clear();
    fills.clear();
    (void)(*pool)->Allocate(1, ns, ctx, &out, &fills);
    (void)(*pool)->Release(ring[head], ctx);
    ring[head] = out[0];
    head = (head + 1) % kHeld;
  }
  KVPOOL_CHECK_OK((*pool)->CheckInvariants());
}
BENCHMARK(BM_PoolAllocateFreeSteady);

void BM_VectorPushPopSteady(benchmark::State& state) {
  std::vector<int32_t> free_list;
  for (int32_t b = 1023; b >= 0; --b) free_list.push_back(b);
  std::vector<int32_t> ring;
  for (int k = 0; k < kHeld; ++k) {
    ring.push_back(free_list.back());
    free_list.pop_back();
  }
  size_t head = 0;
  for (auto _ : state) {
    const int32_t b = free_list.back();
    free_list.pop_back();
    free_list.push_back(ring[head]);
    ring[head] = b;
    head = (head + 1) % kHeld;
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_VectorPushPopSteady);

// --- one sequence: allocate (one block) + free through the manager -----------------------------

void BM_SequenceAllocateFree(benchmark::State& state) {
  auto cache = MakeCache();
  DevicePlan plan;
  for (auto _ : state) {
    plan.fills.clear();
    const absl::StatusOr<AllocateResult> r =
        cache->Allocate(SessionId(1), {NamespaceId(1), kBlockSize}, &plan);
    (void)cache->Free(SessionId(1), r->sequence);
  }
}
BENCHMARK(BM_SequenceAllocateFree);

// --- a one-sequence session's end amid 65,536 other sequences ----------------------------------
// A client that attaches, allocates and detaches over and over: its session's end must cost what
// it held, not the pool (KvCacheManager::FreeSession finds its sequences and pins in the session's
// holdings). The baseline is the same allocate + free through Free, with the pool empty.

constexpr int kOtherSequences = 1 << 16;

void BM_SessionEndAmidOthers(benchmark::State& state) {
  auto cache = MakeCache();
  DevicePlan plan;
  for (int s = 0; s < kOtherSequences; ++s) {
    KVPOOL_CHECK_OK(cache->Allocate(SessionId(2 + s % 64), {NamespaceId(1), 0}, &plan).status());
  }
  for (auto _ : state) {
    plan.fills.clear();
    KVPOOL_CHECK_OK(cache->Allocate(SessionId(1), {NamespaceId(1), kBlockSize}, &plan).status());
    benchmark::DoNotOptimize(cache->FreeSession(SessionId(1)));
  }
}
BENCHMARK(BM_SessionEndAmidOthers);

// --- a new namespace in a full table, amid 65,536 blocks held by others ------------------------
// A client that frees its sequence and asks for a new namespace (a fresh cache salt), with every
// slot of the table in use: each call recycles the slot its last namespace left. That must cost
// O(slots), not a walk of the pool's blocks and sequences (before: two walks of every block and
// one of every sequence per call, under the engine's lock). The baseline is the same allocate +
// free in one namespace.

void BM_NewNamespaceInAFullTable(benchmark::State& state) {
  auto made = KvCacheManager::Create({.block_size = kBlockSize,
                                      .num_blocks = kNumBlocks + 16,
                                      .max_blocks_per_seq = kMaxTokens / kBlockSize,
                                      .max_namespaces = 2});
  KVPOOL_CHECK_OK(made.status());
  KvCacheManager& cache = **made;
  DevicePlan plan;
  // Others: every block but 16, in one namespace.
  for (int s = 0; s < kNumBlocks / 64; ++s) {
    KVPOOL_CHECK_OK(
        cache.Allocate(SessionId(2), {NamespaceId(1), 64 * kBlockSize}, &plan).status());
  }
  uint64_t ns = 2;
  SequenceId mine = cache.Allocate(SessionId(1), {NamespaceId(ns), kBlockSize}, &plan)->sequence;
  for (auto _ : state) {
    plan.fills.clear();
    KVPOOL_CHECK_OK(cache.Free(SessionId(1), mine));
    mine = cache.Allocate(SessionId(1), {NamespaceId(++ns), kBlockSize}, &plan)->sequence;
  }
  KVPOOL_CHECK(cache.pool().stats().namespaces_recycled >=
               static_cast<uint64_t>(state.iterations()));
}
BENCHMARK(BM_NewNamespaceInAFullTable);

// --- allocate + free in a namespace of a quota group of 16,384 namespaces -----------------------
// Each cache salt is its own namespace, so one client can make its tenant's quota group this
// large; checking the quota must cost what a one-namespace quota's check costs (running totals,
// KvCacheManager::Quota), not a walk over the group. The baseline is the same allocate + free in
// a namespace with a quota of its own.

constexpr int kQuotaMembers = 1 << 14;

void QuotaAllocateFree(benchmark::State& state, int members) {
  auto cache = MakeCache();
  for (int i = 1; i <= members; ++i) {
    KVPOOL_CHECK_OK(cache->SetNamespaceQuota(NamespaceId(i), kNumBlocks, /*group=*/7));
  }
  const NamespaceId ns(members / 2 + 1);
  DevicePlan plan;
  for (auto _ : state) {
    plan.fills.clear();
    const absl::StatusOr<AllocateResult> r = cache->Allocate(SessionId(1), {ns, kBlockSize}, &plan);
    (void)cache->Free(SessionId(1), r->sequence);
  }
}
void BM_QuotaGroupAllocateFree(benchmark::State& state) { QuotaAllocateFree(state, kQuotaMembers); }
BENCHMARK(BM_QuotaGroupAllocateFree);
void BM_QuotaOwnAllocateFree(benchmark::State& state) { QuotaAllocateFree(state, 1); }
BENCHMARK(BM_QuotaOwnAllocateFree);

// --- grow by one token across 256 sequences, one batch ----------------------------------------

void BM_GrowBatch256(benchmark::State& state) {
  auto cache = MakeCache();
  std::vector<GrowRequest> step;
  DevicePlan plan;
  for (int s = 0; s < kSequences; ++s) {
    step.push_back({cache->Allocate(SessionId(1), {NamespaceId(1), 0}, &plan)->sequence, 0});
  }
  int64_t tokens = 0;
  for (auto _ : state) {
    if (tokens == kMaxTokens) {
      for (const GrowRequest& r : step) (void)cache->Truncate(SessionId(1), r.sequence, 0);
      tokens = 0;
    }
    ++tokens;
    for (GrowRequest& r : step) r.num_tokens = tokens;
    plan.fills.clear();
    KVPOOL_CHECK_OK(cache->GrowBatch(SessionId(1), step, &plan));
  }
  state.SetItemsProcessed(state.iterations() * kSequences);
}
BENCHMARK(BM_GrowBatch256);

void BM_GrowBatch256_Vectors(benchmark::State& state) {
  std::vector<int32_t> free_list;
  for (int32_t b = kNumBlocks - 1; b >= 0; --b) free_list.push_back(b);
  std::vector<std::vector<int32_t>> tables(kSequences);
  std::vector<int64_t> lengths(kSequences, 0);
  int64_t tokens = 0;
  for (auto _ : state) {
    if (tokens == kMaxTokens) {
      for (auto& table : tables) {
        while (!table.empty()) {
          free_list.push_back(table.back());
          table.pop_back();
        }
      }
      std::fill(lengths.begin(), lengths.end(), 0);
      tokens = 0;
    }
    ++tokens;
    for (int s = 0; s < kSequences; ++s) {
      if (lengths[s]++ % kBlockSize == 0) {
        tables[s].push_back(free_list.back());
        free_list.pop_back();
      }
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * kSequences);
}
BENCHMARK(BM_GrowBatch256_Vectors);

// --- fork + free of a 1000-token sequence (62 shared blocks + a copied partial one) -------------

void BM_ForkFree(benchmark::State& state) {
  auto cache = MakeCache();
  DevicePlan plan;
  const SequenceId parent = cache->Allocate(SessionId(1), {NamespaceId(1), 1000}, &plan)->sequence;
  for (auto _ : state) {
    plan.copies.clear();
    const absl::StatusOr<SequenceId> child = cache->Fork(SessionId(1), parent, &plan);
    (void)cache->Free(SessionId(1), *child);
  }
}
BENCHMARK(BM_ForkFree);

void BM_ForkFree_Vectors(benchmark::State& state) {
  std::vector<int32_t> free_list;
  for (int32_t b = 1023; b >= 0; --b) free_list.push_back(b);
  std::vector<int32_t> parent;
  for (int i = 0; i < 63; ++i) {
    parent.push_back(free_list.back());
    free_list.pop_back();
  }
  std::vector<int32_t> child;
  for (auto _ : state) {
    for (int i = 0; i < 62; ++i) child.push_back(parent[i]);
    child.push_back(free_list.back());  // the copied partial block
    free_list.pop_back();
    free_list.push_back(child.back());
    while (!child.empty()) child.pop_back();
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_ForkFree_Vectors);

// --- a snapshot's tier part: 100,000 host-tier blocks in chains of 8
// ------------------------------ What a WatchEvents snapshot or a resync adds, under the engine's
// shared lock, for a tier that holds that many blocks (docs/events.md, Snapshots). The baseline
// builds the same events from a bare vector of (hash, parent), already in order.

constexpr int64_t kTierBlocks = 100'000;

BlockHash TierHash(int64_t i) { return {.lo = static_cast<uint64_t>(i) + 1, .hi = 0x7137}; }

void BM_SnapshotTierBlocks(benchmark::State& state) {
  auto cache =
      KvCacheManager::Create({.block_size = kBlockSize, .num_blocks = 64, .max_blocks_per_seq = 4});
  KVPOOL_CHECK_OK(cache.status());
  for (int64_t i = 0; i < kTierBlocks; ++i) {
    KvEvent e{.type = KvEventType::kBlockStored,
              .ns = NamespaceId(1),
              .block_hashes = {TierHash(i)},
              .block_size = kBlockSize,
              .medium = KvMedium::kHost};
    if (i % 8 != 0) e.parent_hash = TierHash(i - 1);
    KVPOOL_CHECK_OK((*cache)->AppendTierEvent(std::move(e)));
  }
  uint64_t resume = 0;
  for (auto _ : state) {
    const std::vector<KvEvent> snapshot = (*cache)->SnapshotEvents(&resume);
    benchmark::DoNotOptimize(snapshot.data());
  }
  state.SetItemsProcessed(state.iterations() * kTierBlocks);
}
BENCHMARK(BM_SnapshotTierBlocks)->Unit(benchmark::kMillisecond);

void BM_SnapshotTierBlocks_Vectors(benchmark::State& state) {
  std::vector<std::pair<BlockHash, BlockHash>> held;  // (hash, parent)
  for (int64_t i = 0; i < kTierBlocks; ++i) {
    held.push_back({TierHash(i), i % 8 != 0 ? TierHash(i - 1) : BlockHash{}});
  }
  for (auto _ : state) {
    std::vector<KvEvent> snapshot;
    for (const auto& [hash, parent] : held) {
      if (!snapshot.empty() && snapshot.back().block_hashes.back() == parent) {
        snapshot.back().block_hashes.push_back(hash);
        continue;
      }
      KvEvent e{.type = KvEventType::kBlockStored,
                .ns = NamespaceId(1),
                .block_hashes = {hash},
                .block_size = kBlockSize,
                .medium = KvMedium::kHost};
      if (parent != BlockHash{}) e.parent_hash = parent;
      snapshot.push_back(std::move(e));
    }
    benchmark::DoNotOptimize(snapshot.data());
  }
  state.SetItemsProcessed(state.iterations() * kTierBlocks);
}
BENCHMARK(BM_SnapshotTierBlocks_Vectors)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace kvpool

int main(int argc, char** argv) {
  return kvpool::bench::RunWithRatios(
      argc, argv,
      {
          {"allocate+free one block (BlockPool)", "BM_PoolAllocateFree", "BM_VectorPushPop", 0.3},
          {"allocate+free, 512 held, FIFO (BlockPool)", "BM_PoolAllocateFreeSteady",
           "BM_VectorPushPopSteady", 0.3},
          {"allocate+free one sequence (manager)", "BM_SequenceAllocateFree", "BM_VectorPushPop"},
          {"allocate+session end, 65536 others held", "BM_SessionEndAmidOthers",
           "BM_SequenceAllocateFree"},
          {"new namespace in a full table, 65536 blocks held", "BM_NewNamespaceInAFullTable",
           "BM_SequenceAllocateFree"},
          // Not scaling with the group: the same time as a one-namespace quota, within noise.
          {"allocate+free in a quota group of 16384 namespaces", "BM_QuotaGroupAllocateFree",
           "BM_QuotaOwnAllocateFree", 0.9},
          {"grow 1 token x 256 sequences, one batch", "BM_GrowBatch256", "BM_GrowBatch256_Vectors"},
          {"fork+free, 1000 tokens", "BM_ForkFree", "BM_ForkFree_Vectors"},
          {"snapshot of 100k host-tier blocks", "BM_SnapshotTierBlocks",
           "BM_SnapshotTierBlocks_Vectors"},
      });
}

#pragma once

// PoolState: one pool of the engine (docs/trust-model.md): its arena, the KvCacheManager over
// it, the executor of its DevicePlans, the generation table its KV clients map, its step fences
// and the counters of the model steps it served. Thread-compatible: every method REQUIRES the
// Engine's lock; nothing here waits for the device or for I/O.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/engine/engine_options.h"
#include "daemon/engine/generation_table.h"
#include "daemon/engine/step_timeline.h"
#include "daemon/engine/tenant_counters.h"
#include "daemon/engine/tiers.h"
#include "kernels/device.h"
#include "kernels/plan_executor.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/histogram.h"

namespace kvpool::daemon {

// Block tables of several sequences, or the parts of them a call changed, flat as the wire
// carries them: slice i is blocks[first, first + length) of `blocks` / `generations`, where
// first is the sum of the earlier slices' lengths. With a window group, `window_blocks` /
// `window_generations` are parallel to `blocks` (the same entries of each window table);
// without one they are empty.
struct TableSlice {
  SequenceId sequence;
  int64_t num_tokens = 0;
  int64_t matched_tokens = 0;  // Allocate: leading prompt tokens found in the prefix cache
  int32_t table_offset = 0;    // table entries before it are unchanged (0: the whole table)
  int32_t length = 0;
  BlockId state_slot = kInvalidBlock;  // its slot in the state group (kInvalidBlock: none)
  // The window table's released run (entries past the sinks that left the window), in table
  // entries of the whole table, [begin, end); empty (0, 0) without one or without a window group.
  int32_t window_released_begin = 0;
  int32_t window_released_end = 0;
};
struct Tables {
  std::vector<TableSlice> slices;
  std::vector<BlockId> blocks;
  std::vector<uint32_t> generations;         // parallel to blocks
  std::vector<BlockId> window_blocks;        // parallel to blocks; kInvalidBlock: released
  std::vector<uint32_t> window_generations;  // parallel to blocks; 0 for a released entry
};

// Bucket bounds of the step histograms: 100 us to 10 s, and 1 to 1024 sequences.
inline constexpr double kStepSecondsBounds[] = {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
                                                0.05, 0.1,    0.25, 0.5,  1,      2.5,  5,    10};
inline constexpr double kStepBatchBounds[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};

struct ModelCounters {
  uint64_t steps = 0;
  uint64_t step_sequences = 0;  // sequences summed over steps
  uint64_t prefill_calls = 0;
  uint64_t prefill_computed = 0;
  uint64_t prefill_reused = 0;
  uint64_t decode_tokens = 0;
  uint64_t prefill_chunks = 0;  // chunks that left prompt tokens for a later step
  int64_t busy_ns = 0;          // time in model steps
  // Each step's model time (seconds) and its sequences.
  Histogram step_seconds{kStepSecondsBounds};
  Histogram step_batch{kStepBatchBounds};
};

// The checkpoint interval, in blocks, of a pool of `layout` (KvCacheOptions::checkpoint_interval):
// EngineOptions::checkpoint_interval when positive, none when -1 or without a state group, else
// DefaultCheckpointInterval(state slot bytes, block bytes).
int32_t PoolCheckpointInterval(const EngineOptions& options, const kernels::PoolLayout& layout);
// The state checkpoints the host tier of `pool` keeps (TierOptions::host_checkpoints): none
// without a host tier, checkpoint slots or a state group, or when -1; N when N > 0; else one per
// checkpoint interval of host blocks (at least 1).
int64_t HostCheckpoints(const EngineOptions& options, const PoolOptions& pool);
// The window-group blocks the host tier of a pool of `layout` keeps
// (TierOptions::host_window_blocks): none without a host tier or a window group, or when -1; N
// when N > 0; else as many per host block as the pool has window blocks per block (at least 1).
int64_t HostWindowBlocks(const EngineOptions& options, const kernels::PoolLayout& layout);
// The bytes of checkpoint and of window-block records the disk tier of `pool` keeps beside its
// blocks (TierOptions::disk_checkpoint_bytes, disk_window_bytes): as many records per
// block record as the host tier's rules give (one checkpoint per checkpoint interval; the pool's
// window blocks per block), each padded to 4096 bytes; none without a disk tier or the group.
std::pair<int64_t, int64_t> DiskComponentBytes(const EngineOptions& options,
                                               const PoolOptions& pool);

class PoolState final {
 public:
  // Errors: INVALID_ARGUMENT (options), RESOURCE_EXHAUSTED / INTERNAL (arena, generation table);
  // those of TierSet::Create. `secret` keys the pool's tiers (EngineState::secret()).
  static absl::StatusOr<std::unique_ptr<PoolState>> Create(const PoolOptions& pool,
                                                           const EngineOptions& options,
                                                           kernels::Device* device,
                                                           const tier::DeploymentSecret& secret);
  ~PoolState();  // waits for the device: nothing may touch the arena when it goes

  const std::string& name() const { return name_; }
  kernels::Device& device() const { return *device_; }
  KvCacheManager& cache() { return *cache_; }
  const KvCacheManager& cache() const { return *cache_; }
  const kernels::PoolLayout& layout() const { return layout_; }
  kernels::KvPoolView view() const { return {arena_->base(), layout_}; }
  const kernels::Arena& arena() const { return *arena_; }
  const GenerationTable& generations() const { return *generations_; }
  StepTimeline& steps() { return *steps_; }
  // The pool's lower tiers; null when none is configured.
  TierSet* tiers() const { return tiers_.get(); }

  // Stages for the tiers every full block published since the last call (TierSet::Stage); call
  // it in each lock hold that may publish, before the lock is released. `skip`: hashes just
  // promoted from a tier. A no-op without tiers.
  void StagePublished(std::span<const BlockHash> skip = {});
  // Moves the host tier's events into the pool's event log (numbered with the pool's own).
  void DrainTierEvents();

  // Enqueues `plan`'s device work (the state group's after the blocks', on the same stream),
  // marks the blocks and state slots it touches in flight with that work's fence
  // and publishes the generations of the blocks it hands out. Returns the fence to wait for
  // outside the lock (value 0: nothing to wait for). Errors: the executor's; then what was
  // enqueued before the failure is marked in flight, and the caller undoes the call that made
  // the plan (RevertGrow, Free) at once.
  absl::StatusOr<Fence> Carry(const DevicePlan& plan);

  // Appends `seq`'s table from entry `offset` on to `out`, with its window table's entries and
  // released run when the pool has a window group. Costs O(entries appended + log(table size)).
  void AppendTable(const Sequence& seq, int32_t offset, int64_t matched_tokens, Tables* out) const;

  // The pool's invariants, and that clients see every block's current generation.
  absl::Status CheckInvariants() const;

  ModelCounters model_counters;
  TenantCounterTable tenant_counters{0};  // sized by Create (EngineOptions::max_tenant_labels)
  // Loader sequences of tier promotions alive (started, or held for their call): every sequence
  // of kTierLoader in the pool is one of them (CheckInvariants).
  int64_t loaders = 0;

 private:
  // Marks a group's blocks in flight (KvCacheManager::MarkStatesInFlight, MarkWindowInFlight).
  using MarkGroup = absl::Status (KvCacheManager::*)(std::span<const BlockId>, Fence);
  // Carry's part for the state or window group (`part`, on `executor`), queued after the work
  // fenced at `before`: what it queued is marked in flight with `mark`; returns the later fence.
  absl::StatusOr<Fence> CarryGroup(kernels::PlanExecutor& executor, const DevicePlan& part,
                                   MarkGroup mark, Fence before);

  PoolState(std::string name, const kernels::PoolLayout& layout, kernels::FillPolicy fill,
            kernels::Device* device, std::unique_ptr<kernels::Arena> arena,
            std::unique_ptr<StepTimeline> steps, std::unique_ptr<KvCacheManager> cache,
            std::unique_ptr<GenerationTable> generations, std::unique_ptr<TierSet> tiers);

  const std::string name_;
  const kernels::PoolLayout layout_;
  kernels::Device* const device_;
  const std::unique_ptr<kernels::Arena> arena_;
  const std::unique_ptr<StepTimeline> steps_;  // the cache's FenceObserver
  const std::unique_ptr<KvCacheManager> cache_;
  const std::unique_ptr<GenerationTable> generations_;
  kernels::PlanExecutor executor_;
  // The state group's copies and zeros (over view().StateSlots()); null without a state group.
  std::unique_ptr<kernels::PlanExecutor> state_executor_;
  // The window group's copies and fills (over view().Window()); null without a window group.
  std::unique_ptr<kernels::PlanExecutor> window_executor_;
  const std::unique_ptr<TierSet> tiers_;
  std::vector<PublishedBlock> published_;                   // scratch of StagePublished
  std::vector<BlockHash> sorted_skip_;                      // scratch of StagePublished
  std::vector<PublishedCheckpoint> published_checkpoints_;  // its checkpoints' scratch
  std::vector<PublishedWindowBlock> published_windows_;     // its window blocks' scratch
  std::vector<KvEvent> tier_events_;                        // scratch of DrainTierEvents
};

}  // namespace kvpool::daemon

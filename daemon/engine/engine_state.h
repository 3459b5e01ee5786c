#pragma once

// EngineState: everything the Engine's one coarse lock guards (LevelDB's DBImpl state to the
// Engine's DB): the arena and its KvCacheManager, the executor of DevicePlans, the generation
// table clients map, the step fences, the live sessions and the counters. Every method REQUIRES
// that lock (thread-compatible); nothing here waits for the device or for I/O.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "daemon/engine/engine_options.h"
#include "daemon/engine/generation_table.h"
#include "daemon/engine/session.h"
#include "daemon/engine/step_timeline.h"
#include "kernels/device.h"
#include "kernels/plan_executor.h"
#include "kvpool/kv_cache_manager.h"

namespace kvpool::daemon {

// Block tables of several sequences, or the parts of them a call changed, flat as the wire
// carries them: slice i is blocks[first, first + length) of `blocks` / `generations`, where
// first is the sum of the earlier slices' lengths.
struct TableSlice {
  SequenceId sequence;
  int64_t num_tokens = 0;
  int64_t matched_tokens = 0;  // Allocate: leading prompt tokens found in the prefix cache
  int32_t table_offset = 0;    // table entries before it are unchanged (0: the whole table)
  int32_t length = 0;
};
struct Tables {
  std::vector<TableSlice> slices;
  std::vector<BlockId> blocks;
  std::vector<uint32_t> generations;  // parallel to blocks
};

struct SessionCounters {
  uint64_t opened = 0;
  uint64_t detached = 0;            // ended normally (the client said goodbye)
  uint64_t lost = 0;                // reclaimed: the connection closed without a goodbye
  uint64_t shut_down = 0;           // ended by the daemon's shutdown
  uint64_t sequences_released = 0;  // sequences still held when their session ended
};

struct CallCounters {
  uint64_t gave_up = 0;              // calls whose caller cancelled or ran past its deadline
  uint64_t released_on_give_up = 0;  // sequences created for such callers, released again
  uint64_t session_ended = 0;        // calls refused because their session had ended
  uint64_t device_failures = 0;      // calls whose device work could not be queued (undone)
};

struct ModelCounters {
  uint64_t steps = 0;
  uint64_t step_sequences = 0;  // sequences summed over steps
  uint64_t prefill_calls = 0;
  uint64_t prefill_computed = 0;
  uint64_t prefill_reused = 0;
  uint64_t decode_tokens = 0;
  uint64_t prefill_chunks = 0;  // chunks that left prompt tokens for a later step
  int64_t busy_ns = 0;          // time in model steps
};

class EngineState final {
 public:
  // Errors: INVALID_ARGUMENT (options), RESOURCE_EXHAUSTED / INTERNAL (arena, generation table).
  static absl::StatusOr<std::unique_ptr<EngineState>> Create(const EngineOptions& options,
                                                             kernels::Device* device);
  ~EngineState();  // waits for the device: nothing may touch the arena when it goes

  const EngineOptions& options() const { return options_; }
  kernels::Device& device() const { return *device_; }
  KvCacheManager& cache() { return *cache_; }
  const KvCacheManager& cache() const { return *cache_; }
  const kernels::PoolLayout& layout() const { return options_.layout; }
  kernels::KvPoolView view() const { return {arena_->base(), options_.layout}; }
  const kernels::Arena& arena() const { return *arena_; }
  const GenerationTable& generations() const { return *generations_; }
  StepTimeline& steps() { return *steps_; }
  int64_t now() const { return options_.clock->NowNanos(); }

  // Enqueues `plan`'s device work, marks the blocks it touches in flight with that work's fence
  // and publishes the generations of the blocks it hands out. Returns the fence to wait for
  // outside the lock (value 0: nothing to wait for). Errors: the executor's; then what was
  // enqueued before the failure is marked in flight, nothing is published, and the caller undoes
  // the call that made the plan (RevertGrow, Free) at once.
  absl::StatusOr<Fence> Carry(const DevicePlan& plan);

  // Appends `seq`'s table from entry `offset` on to `out`.
  void AppendTable(const Sequence& seq, int32_t offset, int64_t matched_tokens, Tables* out) const;

  // Sessions.
  NamespaceId NamespaceOf(std::string_view tenant, std::string_view model) const;
  std::shared_ptr<const Session> Open(SessionSpec spec);
  // NOT_FOUND when `id` is not a live session (it ended, or never was).
  absl::Status CheckLive(SessionId id) const;
  std::shared_ptr<const Session> FindByToken(std::string_view token) const;
  // Forgets the session and releases everything it holds. Returns how many sequences; 0 (and
  // nothing counted) when it had ended already.
  int64_t End(SessionId id, SessionEnd how);
  const absl::flat_hash_map<SessionId, std::shared_ptr<const Session>>& sessions() const {
    return live_;
  }

  bool draining = false;
  SessionCounters session_counters;
  CallCounters call_counters;
  ModelCounters model_counters;
  // OK while the engine serves; the device failure that stopped it otherwise.
  absl::Status health;

 private:
  EngineState(const EngineOptions& options, kernels::Device* device,
              std::unique_ptr<kernels::Arena> arena, std::unique_ptr<StepTimeline> steps,
              std::unique_ptr<KvCacheManager> cache, std::unique_ptr<GenerationTable> generations);

  const EngineOptions options_;
  kernels::Device* const device_;
  const std::unique_ptr<kernels::Arena> arena_;
  const std::unique_ptr<StepTimeline> steps_;  // the cache's FenceObserver
  const std::unique_ptr<KvCacheManager> cache_;
  const std::unique_ptr<GenerationTable> generations_;
  kernels::PlanExecutor executor_;
  uint64_t next_session_ = 1;
  absl::flat_hash_map<SessionId, std::shared_ptr<const Session>> live_;
  absl::flat_hash_map<std::string, SessionId> by_token_;
};

}  // namespace kvpool::daemon

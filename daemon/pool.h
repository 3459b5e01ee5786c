#pragma once

// DaemonPool: the daemon's one pool: the device arena, the KvCacheManager over it, the executor
// of its DevicePlans and the shared block-generation table, behind one coarse lock.
//
// Every control call runs in three steps: under the lock, ask the manager, enqueue the plan it
// returns (a queue push or an asynchronous launch, never a wait), mark the plan's blocks in flight
// with its fence and publish the generations of blocks handed out; then, outside the lock, wait
// for that fence, so when the call returns the client may write its blocks at once. Nothing is
// held across a wait or any RPC I/O.
//
// Thread-safe.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/compute_call.h"
#include "daemon/sessions.h"
#include "daemon/step_timeline.h"
#include "kernels/device.h"
#include "kernels/plan_executor.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/v1/attach.pb.h"
#include "kvpool/v1/config.pb.h"
#include "kvpool/v1/kvpool.pb.h"

namespace kvpool::daemon {

// What the attach handshake sends besides the response: descriptors the caller must close after
// sending.
struct AttachGrant {
  v1::AttachResponse response;
  std::vector<int> fds;  // in response.fds order
};

class DaemonPool final {
 public:
  // `device` is not owned and must outlive the pool. Errors: INVALID_ARGUMENT (bad config),
  // RESOURCE_EXHAUSTED / INTERNAL (the device cannot provide the arena).
  static absl::StatusOr<std::unique_ptr<DaemonPool>> Create(const v1::DaemonConfig& config,
                                                            kernels::Device* device,
                                                            uint64_t epoch);
  ~DaemonPool();

  // The namespace of a tenant and model on this pool's layout.
  NamespaceId NamespaceOf(const std::string& tenant, const std::string& model) const;

  // Sets the new session's quotas and fills in everything the client needs to map the pool.
  // Errors: INTERNAL when the arena cannot be exported.
  absl::StatusOr<AttachGrant> Attach(const Session& session);
  // The session's client went away: release everything it held (fenced). Returns how many
  // sequences it had.
  int64_t ReleaseSession(SessionId session);

  // Control calls. Errors as in kvpool.proto; a failed call changes nothing.
  absl::Status Allocate(const Session& s, const v1::AllocateRequest& request,
                        v1::AllocateResponse* response);
  absl::Status Grow(const Session& s, const v1::GrowRequest& request, v1::GrowResponse* response);
  absl::Status Truncate(const Session& s, const v1::TruncateRequest& request);
  absl::Status Fork(const Session& s, const v1::ForkRequest& request, v1::ForkResponse* response);
  absl::Status Commit(const Session& s, const v1::CommitRequest& request);
  absl::Status Free(const Session& s, const v1::FreeRequest& request);
  int64_t MatchPrefix(const Session& s, const v1::MatchPrefixRequest& request) const;

  // Runs one model step over `calls` on the calling thread: under the lock, plans each call (a
  // call whose plan fails gets that error and stays out of the step, changing nothing), carries
  // out the plans' device work and marks every block the step touches in flight with the step's
  // fence (a StepTimeline fence); outside the lock, waits for that device work and runs the
  // step; then, under the lock again, publishes what it computed (or, when it failed, undoes the
  // plans). Sets each call's status and results; does not call `done`. The step is synchronous
  // on every backend (a device model waits for its own stream before it returns), so the step
  // fence passes only once the device is done with the step's blocks.
  // REQUIRES: one caller at a time (the StepRunner).
  //
  // Prefill in chunks: a prefill call computes at most `call->chunk` prompt tokens per step.
  // When tokens are left, the call stays planned (`planned`, `computed`; `finished` false):
  // the caller runs it in a later step again, where its plan is checked still to hold
  // (ABORTED when its sequence was freed or changed meanwhile) before the next chunk.
  void RunStep(model::StepModel* model, std::span<ComputeCall* const> calls);
  // Gives back what a planned call still holds (a prefill left unfinished at shutdown).
  void Abandon(ComputeCall* call);
  // The model the daemon runs: reported by Stats() and told to every session at attach.
  void set_model(std::string name, int32_t vocab_size, int32_t max_position);

  // Admin.
  void Stats(v1::GetStatsResponse* response) const;
  void ListSequences(uint64_t session_id, v1::ListSequencesResponse* response) const;
  absl::Status DumpBlockTrace(const v1::DumpBlockTraceRequest& request,
                              v1::DumpBlockTraceResponse* response) const;
  void Explain(NamespaceId ns, const v1::ExplainMatchRequest& request,
               v1::ExplainMatchResponse* response) const;
  absl::StatusOr<int64_t> Evict(const v1::EvictRequest& request);
  absl::Status CheckInvariants() const;
  // Refuse new sequences from now on; returns how many are still live.
  int64_t Drain();
  bool draining() const;
  // Sequences and block references `session` holds now.
  std::pair<int64_t, int64_t> Usage(SessionId session) const;

  // Cache events from `from` (see EventLog::ReadFrom): false when they were dropped and the
  // consumer needs SnapshotEvents() first.
  bool ReadEvents(uint64_t from, size_t max, std::vector<v1::KvEvent>* out) const;
  std::vector<v1::KvEvent> SnapshotEvents(uint64_t* resume_seq) const;
  uint64_t next_event_seq() const;

  const kernels::PoolLayout& layout() const { return layout_; }
  uint64_t epoch() const { return epoch_; }

 private:
  DaemonPool(const v1::DaemonConfig& config, kernels::Device* device, uint64_t epoch,
             kernels::PoolLayout layout, std::unique_ptr<kernels::Arena> arena,
             std::unique_ptr<StepTimeline> steps, std::unique_ptr<KvCacheManager> cache,
             int generation_fd, uint32_t* generations);

  // Enqueues `plan`, marks its blocks in flight and publishes generations of the blocks it hands
  // out. Returns the fence to wait for outside the lock (value 0: nothing to wait for).
  absl::StatusOr<Fence> Carry(const DevicePlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Wait(Fence fence);
  void Describe(const Sequence& seq, int32_t table_offset, v1::SequenceInfo* info) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const v1::DaemonConfig config_;
  kernels::Device* const device_;
  const uint64_t epoch_;
  const kernels::PoolLayout layout_;
  const absl::Time started_;
  std::unique_ptr<kernels::Arena> arena_;
  const std::unique_ptr<StepTimeline> steps_;  // the cache's FenceObserver

  mutable absl::Mutex mu_;
  std::unique_ptr<KvCacheManager> cache_ ABSL_GUARDED_BY(mu_);
  kernels::PlanExecutor executor_ ABSL_GUARDED_BY(mu_);
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t sessions_reclaimed_ ABSL_GUARDED_BY(mu_) = 0;
  struct ModelCounters {
    std::string name;
    int32_t vocab_size = 0;
    int32_t max_position = 0;
    uint64_t steps = 0;
    uint64_t step_sequences = 0;
    uint64_t prefill_calls = 0;
    uint64_t prefill_computed = 0;
    uint64_t prefill_reused = 0;
    uint64_t decode_tokens = 0;
    uint64_t prefill_chunks = 0;  // chunks that left prompt tokens for a later step
    absl::Duration busy;
  };
  // OK when a planned prefill's sequence is still as its plan left it. Else ABORTED.
  absl::Status CheckPlanned(const ComputeCall& call) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ModelCounters model_ ABSL_GUARDED_BY(mu_);

  // Shared with clients (read-only for them): the generation of every block.
  const int generation_fd_;
  uint32_t* const generations_;
};

}  // namespace kvpool::daemon

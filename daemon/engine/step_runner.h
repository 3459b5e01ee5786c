#pragma once

// StepRunner: the engine's model loop. Prefill and Decode calls queue here, by pool; one thread
// forms steps from them (a StepScheduler per pool: a step's block ids index one pool's arena)
// taking the pools with queued calls in turn, runs each step through its StepExecutor (the
// engine, step_executor.h), then hands every call back through ComputeCall::Complete(), or queues
// a prefill with tokens left for its next chunk.
//
// Waiting, all of it on the injected Clock:
//  - gathering: a step waits until every session of the previous step has queued again, at most
//    `gather_window_ns` after its first call arrived or the previous step ended (whichever is
//    later), so N frontends decoding one sequence each share one step and one read of the weights
//    instead of taking turns;
//  - the queue: before each step, calls whose caller gave up (CallContext) leave the queue with
//    that error, and a prefill between chunks gives back what it holds; the same happens to the
//    calls of a session that ended (SessionEnded) and to everything at Stop().
//
// Steps run one at a time: on the loop thread, or on the thread of a SubmitOrRun that finds the
// runner idle (a decode doorbell's, whose caller waits for its answer anyway).
//
// Thread-safe. Its lock is never held while it calls into the engine or completes a call.

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/engine/compute_call.h"
#include "daemon/engine/step_executor.h"
#include "daemon/engine/step_scheduler.h"
#include "kvpool/util/clock.h"

namespace kvpool::daemon {

class StepRunner final {
 public:
  // Neither is owned; both outlive the runner. Starts the loop thread.
  StepRunner(StepExecutor* executor, int32_t num_pools, const Clock* clock,
             int64_t gather_window_ns, const SchedulerOptions& options);
  ~StepRunner();  // Stop()

  // Queues `call`. After Stop(), completes it at once with UNAVAILABLE.
  void Submit(std::unique_ptr<ComputeCall> call);
  // As Submit, but when no step is being formed or run, no other pool has calls queued, and
  // `call` completes a step at once (the gathering above has nothing left to wait for), runs that
  // step on the calling thread and returns once its calls are complete; otherwise queues `call`
  // as Submit does. For a caller that would only wait for the call anyway (a decode doorbell's
  // thread): its step skips the hand-off to the loop thread and the wake-up back, two thread
  // switches of a decode step's round trip. Steps still run one at a time, in the same order.
  void SubmitOrRun(std::unique_ptr<ComputeCall> call);
  // Completes the queued calls of `session` with NOT_FOUND (the session ended).
  void SessionEnded(SessionId session);
  // Completes queued calls with UNAVAILABLE, lets the step in progress finish (the loop's, or one
  // that SubmitOrRun's caller runs) and joins the loop. Idempotent.
  void Stop();

  // Steps run so far (tests wait on it).
  uint64_t steps() const;

 private:
  void Loop();
  // Waits for calls and the gather window; moves out the next step's calls and the calls whose
  // callers gave up. False when stopping.
  bool NextStep(int32_t* pool, std::vector<std::unique_ptr<ComputeCall>>* step,
                std::vector<std::unique_ptr<ComputeCall>>* dropped);
  // Whether SubmitOrRun's caller takes the next step, `pool`'s: see SubmitOrRun.
  bool MayRunHere(int32_t pool) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The next pool with queued calls after the last one served; -1 when none has any.
  int32_t NextPool() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves out every queued call of every pool `drop` selects.
  std::vector<std::unique_ptr<ComputeCall>> RemoveIf(
      absl::FunctionRef<bool(const ComputeCall&)> drop) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes `calls` with `status` (their own CallContext status when `status` is OK), giving
  // back what prefills between chunks hold.
  void Drop(std::vector<std::unique_ptr<ComputeCall>> calls, const absl::Status& status);
  // Runs `step` (taken by this thread, which set stepping_) and ends it: AfterStep, or for an
  // empty step just clears stepping_.
  void Run(int32_t pool, std::vector<std::unique_ptr<ComputeCall>> step);
  // After a step: completes finished calls, queues the next chunk of the others, clears stepping_.
  void AfterStep(int32_t pool, std::vector<std::unique_ptr<ComputeCall>> step);

  StepExecutor* const executor_;
  const Clock* const clock_;
  const int64_t gather_window_ns_;
  const bool batching_;

  mutable absl::Mutex mu_;
  std::deque<StepScheduler> schedulers_ ABSL_GUARDED_BY(mu_);  // by pool (never moved)
  int32_t last_pool_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t last_step_end_ns_ ABSL_GUARDED_BY(mu_) = INT64_MIN;
  uint64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // A step is being formed (gathering) or run, by the loop thread or by SubmitOrRun's caller:
  // whoever sets it takes and runs the next step; nobody else starts one until it is cleared.
  bool stepping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvpool::daemon

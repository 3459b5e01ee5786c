#pragma once

// StepRunner: the daemon's model loop. Prefill and Decode calls queue here; one thread forms
// model steps from them and runs each through DaemonPool::RunStep, then hands every call back
// through its `done`.
//
// Gathering: the next step waits until every session that was in the previous step has a call
// queued again, at most `gather_window` after its first call arrived or the previous step ended
// (whichever is later), so N frontends decoding one sequence each share one step and one read
// of the weights instead of taking turns. A session that stops decoding costs one window, once.
// With batching off, every call is a step of its own (the comparison point).
//
// Chunked prefill: a step computes at most max_step_tokens tokens. Decodes are served first;
// prefills get what is left (at least one token each), and a prompt longer than that is computed
// over several steps, going back to the front of the queue between them, so decoding sessions
// wait at most one bounded step behind a long prompt instead of behind all of it.
//
// Thread-safe.

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/compute_call.h"
#include "daemon/pool.h"
#include "model/step_model.h"

namespace kvpool::daemon {

class StepRunner final {
 public:
  struct Options {
    absl::Duration gather_window = absl::Milliseconds(2);
    bool batching = true;
    // Tokens a step computes at most (beyond that only when one decode call alone is larger).
    int64_t max_step_tokens = 512;
  };

  // Neither is owned; both outlive the runner. Starts the loop thread.
  StepRunner(DaemonPool* pool, model::StepModel* model, const Options& options);
  ~StepRunner();  // Stop()

  const model::StepModel& model() const { return *model_; }

  // Queues `call`. After Stop(), completes it at once with UNAVAILABLE.
  void Submit(std::unique_ptr<ComputeCall> call);

  // Completes queued calls with UNAVAILABLE, lets the step in progress finish and joins the
  // loop. Idempotent.
  void Stop();

 private:
  void Loop();
  // True when every session expected to join the next step has a call queued.
  bool Gathered() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the next step's calls out of the queue.
  std::vector<std::unique_ptr<ComputeCall>> TakeStep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  DaemonPool* const pool_;
  model::StepModel* const model_;
  const Options options_;

  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<ComputeCall>> queue_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<SessionId, int> queued_ ABSL_GUARDED_BY(mu_);  // calls per session
  // Sessions in the previous step: the ones the next step waits for.
  absl::flat_hash_set<SessionId> expected_ ABSL_GUARDED_BY(mu_);
  absl::Time last_step_end_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvpool::daemon

#pragma once

// StepExecutor: what the StepRunner needs of the engine, and nothing else. The runner forms
// steps and owns the queue; the executor plans, launches and finishes each step under its own
// lock (step.h) and gives back what a call that will not run holds. Engine implements it
// privately, so only the runner it starts (and tests, through
// daemon/engine/internal/step_executor_of.h) can run a step or abandon a call.
//
// Implementations are thread-safe; the runner calls them from its loop thread with no lock of
// its own held.

#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "daemon/engine/compute_call.h"

namespace kvpool::daemon {

class StepExecutor {
 public:
  virtual ~StepExecutor() = default;

  // One step over `calls` (not owned; they outlive the call), all of sessions of pool `pool`:
  // plan, launch, finish. Each call's result holds its outcome afterwards.
  virtual void RunStep(int32_t pool, std::span<ComputeCall* const> calls) = 0;
  // A queued call that will not run (its caller gave up, its session ended, shutdown): a prefill
  // between chunks gives back what it holds, and the call's status becomes `why`.
  virtual void Abandon(ComputeCall& call, const absl::Status& why) = 0;
};

}  // namespace kvpool::daemon

#pragma once

// StepScheduler: which queued compute calls form the next model step. Pure policy (no threads, no
// clock, no pool): the StepRunner feeds it and tests drive it step by step.
//
// A step computes at most `max_step_tokens` tokens:
//  - prefills under way (planned by an earlier step) always join, ahead of everything: they hold
//    their sequences until done;
//  - decodes join in arrival order while they fit (the first always joins, even one wider than a
//    step: it cannot be split, and chunks must not keep it out);
//  - new prefills join while tokens are left; each prefill's chunk is what the decodes leave (at
//    least one token), so a long prompt spreads over several steps.
//
// Fairness (the bound, DESIGN.md §4.7's neighbour): decodes alone could fill every step and keep
// a queued prefill out until its deadline. So a new prefill that `prefill_max_wait_steps` steps
// have passed over joins the next step whatever the decode load, and while any prefill is under
// way or so aged, decodes leave it `prefill_share` tokens of each step (a quarter of the step by
// default). Hence the oldest queued prompt of P tokens starts within prefill_max_wait_steps steps
// and completes within prefill_max_wait_steps + ceil(P / prefill_share) steps, plus the steps of
// prompts queued before it.
//
// Gathering: the next step may wait (the runner's gather window) until every session of the
// previous step has queued again, so decoding sessions share steps instead of taking turns.
//
// Thread-compatible: the runner serializes calls.

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "daemon/engine/compute_call.h"

namespace kvpool::daemon {

struct SchedulerOptions {
  bool batching = true;                // off: every call is a step of its own, in arrival order
  int64_t max_step_tokens = 512;       // > 0
  int32_t prefill_max_wait_steps = 4;  // >= 0: steps a queued prefill may be passed over
  int64_t prefill_share = 0;           // tokens decodes leave to prefills; 0: max_step_tokens / 4
};

class StepScheduler final {
 public:
  explicit StepScheduler(const SchedulerOptions& options);

  // A new call, at the back.
  void Push(std::unique_ptr<ComputeCall> call);
  // A prefill between chunks, at the front (its next chunk goes in the next step).
  void PushFront(std::unique_ptr<ComputeCall> call);

  bool empty() const { return queue_.empty(); }
  size_t size() const { return queue_.size(); }
  // When the oldest queued call arrived (engine clock). REQUIRES: !empty().
  int64_t oldest_arrival() const;

  // Whether the next step can start without waiting for more calls: every session of the
  // previous step has a call queued, or the queued decodes alone fill a step.
  bool Gathered() const;

  // Moves the next step's calls out of the queue (prefills under way first), sets each prefill's
  // chunk, and makes their sessions the ones the step after will wait for. Empty when empty().
  std::vector<std::unique_ptr<ComputeCall>> TakeStep();

  // Moves out every queued call `drop` selects (cancelled, session ended), in queue order.
  std::vector<std::unique_ptr<ComputeCall>> RemoveIf(
      absl::FunctionRef<bool(const ComputeCall&)> drop);

  int64_t prefill_share() const { return share_; }

 private:
  bool aged(const ComputeCall& call) const {
    return call.request().prefill() && call.progress() == nullptr &&
           call.passed_over >= options_.prefill_max_wait_steps;
  }
  // Which queued calls, by position, join the next step.
  std::vector<bool> Choose() const;
  void Count(const ComputeCall& call, int delta);

  const SchedulerOptions options_;
  const int64_t share_;
  std::deque<std::unique_ptr<ComputeCall>> queue_;
  absl::flat_hash_map<SessionId, int> queued_;  // calls per session
  absl::flat_hash_set<SessionId> expected_;     // sessions of the previous step
};

}  // namespace kvpool::daemon

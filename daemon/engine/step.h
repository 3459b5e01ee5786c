#pragma once

// Step: one model step over the pool, as a small state machine the engine drives:
//
//   Plan     (engine lock held)  each call in turn: admitted again (AdmissionGate: session live,
//                                caller still waiting, not draining for a new sequence), planned
//                                against the pool, its
//                                device work enqueued and every block it touches marked in flight
//                                before the next call is planned, so a later call of the same step
//                                can never evict and reuse a block an earlier one still copies
//                                from or computes with. A call that fails here gets its error and
//                                changes nothing (a failed enqueue is undone at once).
//   Launch   (no lock)           waits for the planned device work, then runs the model; control
//                                calls go on meanwhile.
//   Finish   (engine lock held)  publishes what the step computed and fills in the results, or,
//                                when the launch failed, gives back what the plans took. A call
//                                whose caller gave up meanwhile gets its error and leaves nothing
//                                behind: its new sequence is released, the tokens it added to
//                                an existing one are taken back.
//
// A prefill computes at most its chunk per step (ComputeCall::chunk); one with tokens left stays
// planned (PrefillProgress) for the runner to queue again.
//
// Thread-compatible: one runner thread drives a step from start to end.

#include <cstdint>
#include <span>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "daemon/engine/admission.h"
#include "daemon/engine/compute_call.h"
#include "daemon/engine/engine_state.h"
#include "daemon/engine/pool_state.h"
#include "model/step_model.h"

namespace kvpool::daemon {

class Step final {
 public:
  // `calls` as the scheduler took them (prefills under way first), all of sessions of pool
  // `pool`; not owned, they outlive the step, as does `gate`, which admits each call again as
  // the step plans it.
  Step(int32_t pool, std::span<ComputeCall* const> calls, const model::TokenLimits& limits,
       const AdmissionGate& gate)
      : pool_(pool), calls_(calls.begin(), calls.end()), limits_(limits), gate_(gate) {}

  // REQUIRES: the engine lock.
  void Plan(EngineState& state);
  // No call made it past planning: nothing to launch (Finish still completes the step fence).
  bool empty() const { return entries_.empty(); }

  // REQUIRES: the engine lock is NOT held; Plan() ran.
  absl::Status Launch(model::StepModel& model, const Clock& clock);

  // REQUIRES: the engine lock; `launched` is what Launch() returned (OK for an empty step).
  void Finish(EngineState& state, const absl::Status& launched);

  // Gives back what a planned prefill between chunks holds (shutdown, cancellation, session
  // end) and drops its progress. `step_ran`: a step of it ran since its last chunk was counted
  // (its state may have moved). REQUIRES: the engine lock.
  static void Abandon(EngineState& state, ComputeCall& call, bool step_ran = false);

 private:
  // A call that made it past planning, and where its items sit in the model step.
  struct Entry {
    ComputeCall* call;
    std::vector<model::PlannedItem> decode;  // decode: its planned items
    size_t first = 0;                        // its first item in items_ / results_
    size_t count = 0;
  };

  // Plans one call; an error leaves it out of the step with nothing changed.
  absl::Status PlanCall(EngineState& state, ComputeCall& call);
  absl::Status Admit(EngineState& state, const ComputeCall& call) const;
  absl::Status PlanNew(EngineState& state, ComputeCall& call, Entry* entry);
  // A prefill under way: the window blocks of its next chunk, their device work enqueued. On an
  // error the call is abandoned (its sequence given back).
  absl::Status ExtendWindow(EngineState& state, ComputeCall& call);
  void FinishEntry(EngineState& state, Entry& entry);
  // The caller gave up while its step ran: undo what the call did (its new sequence, the tokens
  // it added) and fail it with `gave_up`.
  void GiveBack(EngineState& state, Entry& entry, const absl::Status& gave_up);
  void Undo(EngineState& state, const absl::Status& why);

  const int32_t pool_;
  const std::vector<ComputeCall*> calls_;
  const model::TokenLimits limits_;
  const AdmissionGate& gate_;
  std::vector<Entry> entries_;
  absl::flat_hash_set<SequenceId> in_step_;
  Fence fence_;     // the step's own (StepTimeline): every block it reads or writes
  Fence prepared_;  // the planned device work (transfer stream)
  kernels::KvPoolView view_;
  kernels::Device* device_ = nullptr;
  std::vector<model::StepItem> items_;
  // The items' state checkpoints (StepItem::checkpoints points into it), and each item's range.
  std::vector<model::StateCheckpoint> checkpoints_;
  std::vector<std::pair<size_t, size_t>> checkpoint_ranges_;
  std::vector<model::ItemResult> results_;
  int64_t busy_ns_ = 0;
};

}  // namespace kvpool::daemon

#pragma once

// ComputeCall: one Prefill or Decode RPC on its way through the daemon's model: what the
// session asked for, and, once its step has run, the outcome. Owned by the StepRunner while
// queued; `done` receives it back.

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/sessions.h"
#include "model/step_model.h"
#include "model/step_planner.h"

namespace kvpool::daemon {

struct ComputeCall {
  std::shared_ptr<const Session> session;
  bool prefill = false;
  // Prefill: SequenceId(0) for a new sequence, else the one to extend.
  SequenceId sequence;
  std::vector<int32_t> tokens;
  int priority = 0;
  // Decode: one input per sequence.
  std::vector<model::DecodeInput> decode;
  int32_t top_k = 0;
  absl::Time queued;

  // Chunked prefill. `chunk` (set by the StepRunner) caps the prompt tokens one step computes
  // for this call; a longer prefill stays planned across steps (its sequence and blocks held,
  // nothing published) while decodes of other sessions run between its chunks.
  int64_t chunk = INT64_MAX;
  bool planned = false;  // `items` were planned by an earlier step
  int64_t computed = 0;  // tokens of items[0] computed by earlier steps
  bool finished = true;  // false after a step that left prompt tokens to compute

  // The outcome, set by DaemonPool::RunStep.
  absl::Status status;
  std::vector<model::PlannedItem> items;   // one per prefill / decoded sequence
  std::vector<model::ItemResult> results;  // parallel to items
  std::vector<int64_t> lengths;            // each sequence's length after the step
  int32_t step_sequences = 0;              // sequences in the step that served it

  // Called exactly once with the outcome (on the runner's thread).
  std::function<void(ComputeCall&)> done;

  // Tokens the call has left to compute (an upper bound for a prefill before prefix matching).
  int64_t step_tokens() const {
    if (!prefill) return static_cast<int64_t>(decode.size());
    if (planned) return static_cast<int64_t>(items[0].tokens.size()) - computed;
    return static_cast<int64_t>(tokens.size());
  }
};

}  // namespace kvpool::daemon

#pragma once

// PrefillProgress: one prefill on its way through the steps that compute it, chunk by chunk.
// The first step plans the prefill (prefix match, blocks reserved: a model::PlannedItem); each
// step then computes at most its chunk of the tokens left. Between chunks the sequence holds its
// blocks and nothing is published; before each chunk the plan is checked to still hold, since a
// Free, Truncate or Grow of the client, or the end of its session, may have changed the sequence
// meanwhile (its blocks may be someone else's by then).
//
// Thread-compatible: used under the engine's lock and by the runner thread between steps.

#include <cstdint>

#include "absl/status/status.h"
#include "kvpool/kv_cache_manager.h"
#include "model/step_model.h"
#include "model/step_planner.h"

namespace kvpool::daemon {

class PrefillProgress final {
 public:
  explicit PrefillProgress(model::PlannedItem item) : item_(std::move(item)) {}

  const model::PlannedItem& item() const { return item_; }
  int64_t computed() const { return computed_; }
  int64_t left() const { return static_cast<int64_t>(item_.tokens.size()) - computed_; }
  bool done() const { return left() == 0; }

  // The next chunk: at least one and at most `max_tokens` of the tokens left.
  // REQUIRES: !done().
  model::StepItem NextChunk(int64_t max_tokens) const;
  // The step computed `tokens` of them. REQUIRES: tokens <= left().
  void Advance(int64_t tokens) { computed_ += tokens; }
  // Between chunks: the window group's blocks the computed tokens left behind go back to the pool
  // (model::SlideChunk), and later chunks no longer name them.
  void SlideWindow(KvCacheManager& cache, SessionId owner) {
    model::SlideChunk(cache, owner, item_.start + computed_, &item_);
  }

  // OK while the sequence is as the plan left it (owned by `owner`, as long as planned, the same
  // blocks, the same live window blocks). ABORTED otherwise, saying how far the prefill got.
  absl::Status StillHolds(const KvCacheManager& cache, SessionId owner) const;

 private:
  // Every window block the plan still names is the sequence's entry there.
  bool SameWindow(const Sequence& seq) const;

  model::PlannedItem item_;
  int64_t computed_ = 0;
};

}  // namespace kvpool::daemon

#pragma once

// ComputeCall: one Prefill or Decode on its way through the engine's model steps. Each part has
// one writer:
//   request   what the session asked for; immutable
//   result    the outcome; written by the step that completes the call (Step)
//   progress  a prefill under way between chunks (PrefillProgress); owned here, advanced by Step
//   queue     the scheduler's bookkeeping (arrival, steps passed over, this step's chunk)
//   promotion blocks the tiers had for a new sequence's prompt, held until its plan adopts them;
//             set by Engine::Submit, released (engine lock held) by Step when it plans or drops
//             the call
// The StepRunner owns the call while it is queued or in a step and hands it to `done` exactly once.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/engine/call_context.h"
#include "daemon/engine/prefill_progress.h"
#include "daemon/engine/promotion_hold.h"
#include "daemon/engine/session.h"
#include "model/step_model.h"
#include "model/step_planner.h"

namespace kvpool::daemon {

struct ComputeRequest {
  enum class Kind : uint8_t { kPrefill, kDecode };
  Kind kind = Kind::kDecode;
  // Prefill: SequenceId(0) for a new sequence (prefix-matched), else the one to extend.
  SequenceId sequence;
  std::vector<int32_t> tokens;  // prefill: the prompt (or the next turn)
  int priority = 0;             // prefill of a new sequence: prefix-cache class
  std::string
      cache_salt;  // prefill of a new sequence: its namespace (EngineState::SaltedNamespace)
  std::vector<model::DecodeInput> decode;  // decode: one input per sequence, all or none
  int32_t top_k = 0;  // also return the top_k next tokens (the step runs the widest of its calls)
  // How each next token is chosen: empty, greedy; one, every sequence's; otherwise one per decode
  // input, in order (a prefill takes at most one). Each seed is the caller's or already drawn.
  std::vector<model::SamplingParams> sampling;
  bool logprobs = false;  // also return each next token's log-probability

  // The parameters of the call's `i`th sequence; null: greedy.
  const model::SamplingParams* sampling_for(size_t i) const {
    if (sampling.empty()) return nullptr;
    return &sampling[sampling.size() == 1 ? 0 : i];
  }

  bool prefill() const { return kind == Kind::kPrefill; }
  bool creates() const { return prefill() && sequence == SequenceId(0); }
};

// INVALID_ARGUMENT when the call's sampling parameters do not fit it: a count CheckSamplingCount
// refuses, or a value out of range for a vocabulary of `vocab` (model::CheckSampling; the message
// names the sequence's index).
absl::Status CheckSamplingOf(const ComputeRequest& request, int32_t vocab);
// The count alone, which an edge checks before it builds a set per sequence: INVALID_ARGUMENT for
// `sets` sets of sampling parameters for `items` sequences other than none, one for all, or one
// per sequence (a prefill has one sequence and takes at most one set).
absl::Status CheckSamplingCount(size_t sets, size_t items, bool prefill);

struct ComputeResult {
  absl::Status status;
  // One per sequence (a prefill has one), in request order.
  std::vector<SequenceId> sequences;
  std::vector<model::ItemResult> results;
  std::vector<int64_t> lengths;  // each sequence's tokens with K/V in the pool after the call
  int64_t reused = 0;            // prefill: prompt tokens the prefix cache supplied
  int64_t computed = 0;          // prefill: tokens the model computed
  int32_t step_sequences = 0;    // sequences in the step that completed the call
};

class ComputeCall final {
 public:
  using Done = std::function<void(ComputeCall&)>;

  // `context` says whether the caller still waits (CallContext::Uncancellable() when null).
  ComputeCall(std::shared_ptr<const Session> session, ComputeRequest request,
              std::shared_ptr<const CallContext> context, Done done)
      : session_(std::move(session)),
        request_(std::move(request)),
        context_(std::move(context)),
        done_(std::move(done)) {
    session_->compute_calls.fetch_add(1, std::memory_order_relaxed);
  }
  ~ComputeCall() {
    if (!answered_) session_->compute_calls.fetch_sub(1, std::memory_order_relaxed);
  }
  ComputeCall(const ComputeCall&) = delete;
  ComputeCall& operator=(const ComputeCall&) = delete;

  const Session& session() const { return *session_; }
  const std::shared_ptr<const Session>& shared_session() const { return session_; }
  const ComputeRequest& request() const { return request_; }
  const CallContext& context() const { return context_ ? *context_ : CallContext::Uncancellable(); }
  ComputeResult& result() { return result_; }
  const ComputeResult& result() const { return result_; }

  // A prefill planned by an earlier step and not finished: its sequence and blocks are held.
  PrefillProgress* progress() { return progress_ ? &*progress_ : nullptr; }
  const PrefillProgress* progress() const { return progress_ ? &*progress_ : nullptr; }
  void StartProgress(model::PlannedItem item) { progress_.emplace(std::move(item)); }
  void EndProgress() { progress_.reset(); }
  // The call needs another step (a prefill with prompt tokens left).
  bool unfinished() const { return progress_ && !progress_->done() && result_.status.ok(); }

  // Tokens the call computes in its next step at most (a prefill before prefix matching: all).
  int64_t step_tokens() const {
    if (!request_.prefill()) return static_cast<int64_t>(request_.decode.size());
    if (progress_) return progress_->left();
    return static_cast<int64_t>(request_.tokens.size());
  }

  std::optional<PromotionHold> promotion;

  // Scheduler bookkeeping (StepScheduler).
  int64_t arrived_ns = 0;     // engine clock, when submitted
  int32_t passed_over = 0;    // steps formed while a new prefill waited outside them
  int64_t chunk = INT64_MAX;  // prompt tokens this step may compute for a prefill

  // Hands the call to its owner's callback. Called once. From then on it no longer counts
  // against its session's queued_calls_per_session: the callback may queue the next call (a
  // Generate stream's next decode), and a step destroys its calls only once all are answered.
  void Complete() {
    answered_ = true;
    session_->compute_calls.fetch_sub(1, std::memory_order_relaxed);
    done_(*this);
  }

 private:
  const std::shared_ptr<const Session> session_;
  const ComputeRequest request_;
  const std::shared_ptr<const CallContext> context_;
  const Done done_;
  bool answered_ = false;  // Complete() ran
  ComputeResult result_;
  std::optional<PrefillProgress> progress_;
};

}  // namespace kvpool::daemon

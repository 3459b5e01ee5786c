#pragma once

// Generation: a Generate call as the engine runs it. One Prefill of the prompt, then one Decode
// per token, each submitted only once the previous token reached the caller (a slow reader holds
// one step's worth of work, not a queue of them). It ends, in this order of precedence, when a
// step fails (that step's error), when the caller cannot be written to (CANCELLED "client went
// away"), after `max_tokens` tokens or a stop token (OK), or when the caller cancels (CANCELLED).
// A sequence it created is freed when it ends before the caller received a token (the caller
// never learned the sequence's id), and with `free_when_done` (committed to the prefix cache on OK,
// discarded otherwise).
//
// The edge only writes what the generation yields (the gRPC reactor in
// daemon/edge/service_compute.cc); the generation itself needs no transport, so tests drive it
// with an engine alone. (Not to be confused with a block's generation, GenerationTable.)
//
// Threads: Start, Delivered and Cancel from any thread; the sink is called from the engine's step
// runner (or from Start's thread, for a call the engine refuses at once), never with a lock of the
// generation held and never twice at a time: OnToken, then nothing until Delivered; OnEnd last.

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/engine/call_context.h"
#include "daemon/engine/compute_call.h"
#include "daemon/engine/session.h"
#include "model/sampling.h"

namespace kvpool::daemon {

class Engine;

struct GenerationRequest {
  SequenceId sequence;          // SequenceId(0): a new sequence, prefix-matched; else extend it
  std::vector<int32_t> prompt;  // the prompt (or the next turn of `sequence`)
  int priority = 0;             // a new sequence's prefix-cache class
  std::string cache_salt;       // a new sequence's namespace
  int32_t top_k = 0;            // also yield the top_k next tokens of each step
  // How each token is chosen; none: greedy. The seed is the caller's or already drawn: the
  // stream's tokens are a function of it and the prompt alone.
  std::optional<model::SamplingParams> sampling;
  bool logprobs = false;             // also yield each token's log-probability
  int32_t max_tokens = 0;            // >= 1
  std::vector<int32_t> stop_tokens;  // a token among these ends the stream after it is yielded
  bool free_when_done = false;       // free the sequence when the stream ends
};

// One token of a stream.
struct GeneratedToken {
  SequenceId sequence;
  int32_t index = 0;  // 0 for the prefill's token, then 1, 2, ...
  int32_t token = 0;
  float logprob = 0;                     // with `logprobs`
  std::vector<model::TokenLogProb> top;  // with `top_k`
  std::optional<int64_t> reused_tokens;  // the prefill's token only: prompt tokens reused
};

class Generation final {
 public:
  class Sink {
   public:
    virtual ~Sink() = default;
    // A token for the caller. The sink hands it on and calls Delivered() once it was written (or
    // could not be).
    virtual void OnToken(const GeneratedToken& token) = 0;
    // The stream ended with `status`. Called once and last: the sink may destroy the generation
    // from inside it.
    virtual void OnEnd(const absl::Status& status) = 0;
  };

  // `engine` and `sink` must outlive the generation's end (OnEnd). `context` says whether the
  // caller still waits for each step.
  Generation(Engine* engine, std::shared_ptr<const Session> session, GenerationRequest request,
             std::shared_ptr<const CallContext> context, Sink* sink);
  Generation(const Generation&) = delete;
  Generation& operator=(const Generation&) = delete;

  // Submits the prefill. A request the generation cannot run (max_tokens < 1) ends at once with
  // INVALID_ARGUMENT; everything else is the engine's to refuse (Engine::Submit), step by step.
  // Called once.
  void Start();
  // The last OnToken's token reached the caller (`ok`), or the caller is gone (`!ok`).
  void Delivered(bool ok);
  // The caller gave up: the stream ends at its next boundary (at once while nothing is in flight).
  void Cancel();

  // INVALID_ARGUMENT when `request` cannot run whatever the engine says (max_tokens < 1).
  static absl::Status Check(const GenerationRequest& request);

 private:
  void Submit(ComputeRequest request);
  void OnStep(ComputeCall& call);
  // Marks the stream ended; returns the status to end with, or nothing when it had ended.
  std::optional<absl::Status> End(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees what the stream must not leave behind, then tells the sink. Touches nothing after.
  void Finish(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  Engine* const engine_;
  const std::shared_ptr<const Session> session_;
  const GenerationRequest request_;
  const std::shared_ptr<const CallContext> context_;
  Sink* const sink_;
  absl::Mutex mu_;
  SequenceId sequence_ ABSL_GUARDED_BY(mu_);
  bool created_ ABSL_GUARDED_BY(mu_) = false;    // the stream's prefill made the sequence
  bool delivered_ ABSL_GUARDED_BY(mu_) = false;  // a token reached the caller
  int32_t last_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t produced_ ABSL_GUARDED_BY(mu_) = 0;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // a step of ours or a delivery is in flight
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvpool::daemon

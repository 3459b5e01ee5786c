#include "daemon/engine/generation.h"

#include <algorithm>
#include <span>
#include <utility>

#include "daemon/engine/engine.h"
#include "fmt/format.h"
#include "kvpool/util/logging.h"

namespace kvpool::daemon {

Generation::Generation(Engine* engine, std::shared_ptr<const Session> session,
                       GenerationRequest request, std::shared_ptr<const CallContext> context,
                       Sink* sink)
    : engine_(engine),
      session_(std::move(session)),
      request_(std::move(request)),
      context_(std::move(context)),
      sink_(sink) {}

absl::Status Generation::Check(const GenerationRequest& request) {
  if (request.max_tokens < 1) {
    return absl::InvalidArgumentError(
        fmt::format("generate: max_tokens {} must be >= 1", request.max_tokens));
  }
  return absl::OkStatus();
}

void Generation::Start() {
  if (absl::Status invalid = Check(request_); !invalid.ok()) {
    {
      absl::MutexLock lock(&mu_);
      ended_ = true;
    }
    return Finish(invalid);
  }
  {
    absl::MutexLock lock(&mu_);
    busy_ = true;
  }
  std::vector<model::SamplingParams> sampling;
  if (request_.sampling.has_value()) sampling.push_back(*request_.sampling);
  // Outside the lock: an engine that refuses completes the call at once, on this thread.
  Submit({.kind = ComputeRequest::Kind::kPrefill,
          .sequence = request_.sequence,
          .tokens = request_.prompt,
          .priority = request_.priority,
          .cache_salt = request_.cache_salt,
          .top_k = request_.top_k,
          .sampling = std::move(sampling),
          .logprobs = request_.logprobs});
}

void Generation::Delivered(bool ok) {
  std::optional<absl::Status> end;
  ComputeRequest next{.kind = ComputeRequest::Kind::kDecode,
                      .top_k = request_.top_k,
                      .logprobs = request_.logprobs};
  {
    absl::MutexLock lock(&mu_);
    busy_ = false;
    if (!ok) {
      end = End(absl::CancelledError("client went away"));
    } else {
      delivered_ = true;  // the caller knows the sequence now
      const bool stop = std::find(request_.stop_tokens.begin(), request_.stop_tokens.end(),
                                  last_) != request_.stop_tokens.end();
      if (produced_ >= request_.max_tokens || stop) {
        end = End(absl::OkStatus());
      } else if (cancelled_) {
        end = End(absl::CancelledError("cancelled"));
      } else {
        // A shutdown lets the stream run on within its drain timeout; past it the engine stops
        // computing, and the next step's UNAVAILABLE ends the stream.
        busy_ = true;
        next.decode = {{sequence_, last_}};
      }
    }
  }
  if (end.has_value()) return Finish(*end);
  if (request_.sampling.has_value()) next.sampling.push_back(*request_.sampling);
  Submit(std::move(next));
}

void Generation::Cancel() {
  std::optional<absl::Status> end;
  {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (!busy_) end = End(absl::CancelledError("cancelled"));
  }
  if (end.has_value()) Finish(*end);
}

void Generation::Submit(ComputeRequest request) {
  engine_->Submit(std::make_unique<ComputeCall>(session_, std::move(request), context_,
                                                [this](ComputeCall& c) { OnStep(c); }));
}

// A step of ours completed (the runner's thread).
void Generation::OnStep(ComputeCall& call) {
  std::optional<absl::Status> end;
  GeneratedToken token;
  {
    absl::MutexLock lock(&mu_);
    busy_ = false;
    const ComputeResult& done = call.result();
    if (done.status.ok() && call.request().prefill()) {
      sequence_ = done.sequences[0];
      created_ = call.request().creates();
      token.reused_tokens = done.reused;
    }
    if (!done.status.ok()) {
      end = End(done.status);
    } else if (cancelled_) {
      end = End(absl::CancelledError("cancelled"));
    } else {
      const model::ItemResult& result = done.results[0];
      last_ = result.next_token;
      token.sequence = sequence_;
      token.index = produced_++;
      token.token = result.next_token;
      if (request_.logprobs) token.logprob = result.logprob;
      if (request_.top_k > 0) token.top = result.top;
      busy_ = true;  // until Delivered
    }
  }
  if (end.has_value()) return Finish(*end);
  sink_->OnToken(token);
}

std::optional<absl::Status> Generation::End(absl::Status status) {
  if (ended_) return std::nullopt;
  ended_ = true;
  return status;
}

void Generation::Finish(const absl::Status& status) {
  SequenceId sequence;
  bool free = false;
  {
    absl::MutexLock lock(&mu_);
    const bool orphan = created_ && !delivered_;  // the caller never learned of it
    sequence = sequence_;
    free = sequence != SequenceId(0) && (request_.free_when_done || orphan);
  }
  if (free) {
    const OnFree mode = status.ok() ? OnFree::kCommit : OnFree::kDiscard;
    if (absl::Status s = engine_->FreeForStream(*session_, sequence, mode);
        !s.ok() && !absl::IsNotFound(s)) {
      Logger("daemon").warn("generate: freeing sequence {}: {}", sequence.value(), s.ToString());
    }
  }
  sink_->OnEnd(status);
}

}  // namespace kvpool::daemon

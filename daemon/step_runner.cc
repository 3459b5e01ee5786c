#include "daemon/step_runner.h"

#include <algorithm>
#include <utility>

namespace kvpool::daemon {

StepRunner::StepRunner(DaemonPool* pool, model::StepModel* model, const Options& options)
    : pool_(pool), model_(model), options_(options), thread_([this] { Loop(); }) {}

StepRunner::~StepRunner() { Stop(); }

void StepRunner::Submit(std::unique_ptr<ComputeCall> call) {
  call->queued = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      ++queued_[call->session->id];
      queue_.push_back(std::move(call));
      return;
    }
  }
  call->status = absl::UnavailableError("kvpoold is shutting down");
  call->done(*call);
}

void StepRunner::Stop() {
  std::deque<std::unique_ptr<ComputeCall>> dropped;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
    dropped.swap(queue_);
    queued_.clear();
  }
  for (std::unique_ptr<ComputeCall>& call : dropped) {
    pool_->Abandon(call.get());  // a prefill between chunks gives its sequence back
    call->status = absl::UnavailableError("kvpoold is shutting down");
    call->done(*call);
  }
  if (thread_.joinable()) thread_.join();
}

bool StepRunner::Gathered() const {
  // Decodes alone can fill a step; prompt tokens cannot, since a prefill is chunked to whatever
  // the decodes leave: a long prompt in the queue is no reason to start without the decoders.
  int64_t tokens = 0;
  for (const auto& call : queue_) {
    if (!call->prefill) tokens += call->step_tokens();
  }
  if (tokens >= options_.max_step_tokens) return true;
  for (SessionId s : expected_) {
    if (!queued_.contains(s)) return false;
  }
  return true;
}

std::vector<std::unique_ptr<ComputeCall>> StepRunner::TakeStep() {
  // Which queued calls join, by position: prefills already under way (always: they hold their
  // sequences until done), then decodes in arrival order while they fit, then new prefills while
  // tokens are left. Prefill chunks get what the decodes leave of max_step_tokens (at least one
  // token each), so a long prompt never holds decoding sessions up for more than a step.
  std::vector<bool> take(queue_.size(), false);
  int64_t tokens = 0;
  bool any = false;
  for (size_t i = 0; i < queue_.size(); ++i) {
    if (queue_[i]->planned) take[i] = any = true;
  }
  for (size_t i = 0; i < queue_.size(); ++i) {
    const ComputeCall& call = *queue_[i];
    if (call.prefill) continue;
    if (!options_.batching && any) break;
    // The first decode call always goes, even one wider than a step: it cannot be split, and
    // chunks under way must not keep it out for ever.
    if (tokens > 0 && tokens + call.step_tokens() > options_.max_step_tokens) break;
    take[i] = any = true;
    tokens += call.step_tokens();
  }
  for (size_t i = 0; i < queue_.size(); ++i) {
    const ComputeCall& call = *queue_[i];
    if (!call.prefill || call.planned) continue;
    if (any && (!options_.batching || tokens >= options_.max_step_tokens)) break;
    take[i] = any = true;
    tokens += call.step_tokens();  // an upper bound: its chunk may be smaller
  }
  int64_t left = options_.max_step_tokens;
  for (size_t i = 0; i < queue_.size(); ++i) {
    if (take[i] && !queue_[i]->prefill) left -= queue_[i]->step_tokens();
  }
  std::vector<std::unique_ptr<ComputeCall>> step;
  std::deque<std::unique_ptr<ComputeCall>> rest;
  for (size_t i = 0; i < queue_.size(); ++i) {
    std::unique_ptr<ComputeCall>& call = queue_[i];
    if (!take[i]) {
      rest.push_back(std::move(call));
      continue;
    }
    if (call->prefill) {
      call->chunk = std::max<int64_t>(1, left);
      left -= std::min(call->chunk, call->step_tokens());
    }
    SessionId s = call->session->id;
    if (--queued_[s] == 0) queued_.erase(s);
    step.push_back(std::move(call));
  }
  queue_.swap(rest);
  // Prefills under way first: RunStep then sees their sequences before any other call's.
  std::stable_partition(step.begin(), step.end(), [](const auto& c) { return c->planned; });
  return step;
}

void StepRunner::Loop() {
  for (;;) {
    std::vector<std::unique_ptr<ComputeCall>> step;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](StepRunner* r)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return r->stop_ || !r->queue_.empty(); },
          this));
      if (stop_) return;
      if (options_.batching && options_.gather_window > absl::ZeroDuration()) {
        // The window opens when the call arrived or the runner came free, whichever is later:
        // calls that queued during a long step would otherwise find it closed already.
        const absl::Time deadline =
            std::max(queue_.front()->queued, last_step_end_) + options_.gather_window;
        mu_.AwaitWithDeadline(absl::Condition(
                                  +[](StepRunner* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                    return r->stop_ || r->Gathered();
                                  },
                                  this),
                              deadline);
        if (stop_) return;
      }
      step = TakeStep();
      // Everyone in this step is expected in the next one: a decoding session decodes again,
      // a session that prefilled starts decoding.
      expected_.clear();
      for (const auto& call : step) expected_.insert(call->session->id);
    }
    std::vector<ComputeCall*> calls;
    for (const auto& call : step) calls.push_back(call.get());
    pool_->RunStep(model_, calls);
    {
      absl::MutexLock lock(&mu_);
      last_step_end_ = absl::Now();
    }
    std::vector<std::unique_ptr<ComputeCall>> unfinished;
    for (auto& call : step) {
      if (call->finished) {
        call->done(*call);
      } else {
        unfinished.push_back(std::move(call));
      }
    }
    if (unfinished.empty()) continue;
    // The next chunk goes in the next step, ahead of everything queued meanwhile.
    bool stopping;
    {
      absl::MutexLock lock(&mu_);
      stopping = stop_;
      if (!stopping) {
        for (auto it = unfinished.rbegin(); it != unfinished.rend(); ++it) {
          ++queued_[(*it)->session->id];
          queue_.push_front(std::move(*it));
        }
      }
    }
    if (stopping) {
      for (auto& call : unfinished) {
        pool_->Abandon(call.get());
        call->status = absl::UnavailableError("kvpoold is shutting down");
        call->done(*call);
      }
    }
  }
}

}  // namespace kvpool::daemon

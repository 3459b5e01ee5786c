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
    call->status = absl::UnavailableError("kvpoold is shutting down");
    call->done(*call);
  }
  if (thread_.joinable()) thread_.join();
}

bool StepRunner::Gathered() const {
  int64_t tokens = 0;
  for (const auto& call : queue_) tokens += call->step_tokens();
  if (tokens >= options_.max_step_tokens) return true;
  for (SessionId s : expected_) {
    if (!queued_.contains(s)) return false;
  }
  return true;
}

std::vector<std::unique_ptr<ComputeCall>> StepRunner::TakeStep() {
  std::vector<std::unique_ptr<ComputeCall>> step;
  int64_t tokens = 0;
  while (!queue_.empty()) {
    const int64_t more = queue_.front()->step_tokens();
    if (!step.empty() && (!options_.batching || tokens + more > options_.max_step_tokens)) break;
    tokens += more;
    SessionId s = queue_.front()->session->id;
    if (--queued_[s] == 0) queued_.erase(s);
    step.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  return step;
}

void StepRunner::Loop() {
  for (;;) {
    std::vector<std::unique_ptr<ComputeCall>> step;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](StepRunner* r) ABSL_NO_THREAD_SAFETY_ANALYSIS { return r->stop_ || !r->queue_.empty(); },
          this));
      if (stop_) return;
      if (options_.batching && options_.gather_window > absl::ZeroDuration()) {
        // The window opens when the call arrived or the runner came free, whichever is later:
        // calls that queued during a long step would otherwise find it closed already.
        const absl::Time deadline =
            std::max(queue_.front()->queued, last_step_end_) + options_.gather_window;
        mu_.AwaitWithDeadline(
            absl::Condition(
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
    for (const auto& call : step) call->done(*call);
  }
}

}  // namespace kvpool::daemon

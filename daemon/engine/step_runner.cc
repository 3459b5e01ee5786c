#include "daemon/engine/step_runner.h"

#include <algorithm>
#include <utility>

#include "daemon/engine/engine.h"
#include "fmt/format.h"
#include "kvpool/util/fmt.h"

namespace kvpool::daemon {

StepRunner::StepRunner(Engine* engine, const Clock* clock, int64_t gather_window_ns,
                       const SchedulerOptions& options)
    : engine_(engine),
      clock_(clock),
      gather_window_ns_(gather_window_ns),
      batching_(options.batching),
      scheduler_(options),
      thread_([this] { Loop(); }) {}

StepRunner::~StepRunner() { Stop(); }

void StepRunner::Submit(std::unique_ptr<ComputeCall> call) {
  call->arrived_ns = clock_->NowNanos();
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      scheduler_.Push(std::move(call));
      return;
    }
  }
  call->result().status = absl::UnavailableError("kvpoold is shutting down");
  call->Complete();
}

void StepRunner::SessionEnded(SessionId session) {
  std::vector<std::unique_ptr<ComputeCall>> dropped;
  {
    absl::MutexLock lock(&mu_);
    dropped = scheduler_.RemoveIf(
        [session](const ComputeCall& call) { return call.session().id == session; });
  }
  Drop(std::move(dropped),
       absl::NotFoundError(fmt::format("session {} has ended", session.value())));
}

void StepRunner::Stop() {
  std::vector<std::unique_ptr<ComputeCall>> dropped;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
    dropped = scheduler_.RemoveIf([](const ComputeCall&) { return true; });
  }
  Drop(std::move(dropped), absl::UnavailableError("kvpoold is shutting down"));
  if (thread_.joinable()) thread_.join();
}

uint64_t StepRunner::steps() const {
  absl::MutexLock lock(&mu_);
  return steps_;
}

void StepRunner::Drop(std::vector<std::unique_ptr<ComputeCall>> calls, const absl::Status& status) {
  for (std::unique_ptr<ComputeCall>& call : calls) {
    // A prefill between chunks gives its sequence back.
    engine_->Abandon(*call, status.ok() ? call->context().Check() : status);
    call->Complete();
  }
}

bool StepRunner::NextStep(std::vector<std::unique_ptr<ComputeCall>>* step,
                          std::vector<std::unique_ptr<ComputeCall>>* dropped) {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](StepRunner* r)
           ABSL_NO_THREAD_SAFETY_ANALYSIS { return r->stop_ || !r->scheduler_.empty(); },
      this));
  if (stop_) return false;
  if (batching_ && gather_window_ns_ > 0) {
    // The window opens when the call arrived or the runner came free, whichever is later: calls
    // that queued during a long step would otherwise find it closed already.
    const int64_t deadline =
        std::max(scheduler_.oldest_arrival(), last_step_end_ns_) + gather_window_ns_;
    clock_->AwaitUntil(mu_,
                       absl::Condition(
                           +[](StepRunner* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                             return r->stop_ || r->scheduler_.Gathered();
                           },
                           this),
                       deadline);
    if (stop_) return false;
  }
  // Callers that gave up while queued leave before anything is planned for them.
  *dropped =
      scheduler_.RemoveIf([](const ComputeCall& call) { return !call.context().Check().ok(); });
  *step = scheduler_.TakeStep();
  return true;
}

void StepRunner::Loop() {
  for (;;) {
    std::vector<std::unique_ptr<ComputeCall>> step, dropped;
    if (!NextStep(&step, &dropped)) return;
    Drop(std::move(dropped), absl::OkStatus());
    if (step.empty()) continue;
    std::vector<ComputeCall*> calls;
    calls.reserve(step.size());
    for (const auto& call : step) calls.push_back(call.get());
    engine_->RunStep(calls);
    AfterStep(std::move(step));
  }
}

void StepRunner::AfterStep(std::vector<std::unique_ptr<ComputeCall>> step) {
  std::vector<std::unique_ptr<ComputeCall>> finished, stopped;
  {
    absl::MutexLock lock(&mu_);
    last_step_end_ns_ = clock_->NowNanos();
    ++steps_;
    // The next chunks go in the next step, ahead of everything queued meanwhile.
    for (auto it = step.rbegin(); it != step.rend(); ++it) {
      if (!(*it)->unfinished()) {
        finished.push_back(std::move(*it));
      } else if (stop_) {
        stopped.push_back(std::move(*it));
      } else {
        scheduler_.PushFront(std::move(*it));
      }
    }
  }
  for (auto it = finished.rbegin(); it != finished.rend(); ++it) (*it)->Complete();
  Drop(std::move(stopped), absl::UnavailableError("kvpoold is shutting down"));
}

}  // namespace kvpool::daemon

#include "daemon/engine/step_runner.h"

#include <algorithm>
#include <utility>

#include "fmt/format.h"
#include "kvpool/util/fmt.h"

namespace kvpool::daemon {

StepRunner::StepRunner(StepExecutor* executor, int32_t num_pools, const Clock* clock,
                       int64_t gather_window_ns, const SchedulerOptions& options)
    : executor_(executor),
      clock_(clock),
      gather_window_ns_(gather_window_ns),
      batching_(options.batching) {
  absl::MutexLock lock(&mu_);
  for (int32_t p = 0; p < num_pools; ++p) schedulers_.emplace_back(options);
  thread_ = std::thread([this] { Loop(); });
}

StepRunner::~StepRunner() { Stop(); }

void StepRunner::Submit(std::unique_ptr<ComputeCall> call) {
  call->arrived_ns = clock_->NowNanos();
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      schedulers_[static_cast<size_t>(call->session().pool)].Push(std::move(call));
      return;
    }
  }
  std::vector<std::unique_ptr<ComputeCall>> stopped;
  stopped.push_back(std::move(call));
  Drop(std::move(stopped), absl::UnavailableError("kvpoold is shutting down"));
}

void StepRunner::SubmitOrRun(std::unique_ptr<ComputeCall> call) {
  call->arrived_ns = clock_->NowNanos();
  const int32_t pool = call->session().pool;
  std::vector<std::unique_ptr<ComputeCall>> step, dropped;
  bool stopped = false;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) {
      stopped = true;
      dropped.push_back(std::move(call));
    } else {
      schedulers_[static_cast<size_t>(pool)].Push(std::move(call));
      if (!MayRunHere(pool)) return;  // the loop thread takes it
      stepping_ = true;
      // As NextStep: callers that gave up while queued leave before anything is planned.
      dropped = RemoveIf([](const ComputeCall& c) { return !c.context().Check().ok(); });
      step = schedulers_[static_cast<size_t>(pool)].TakeStep();
      last_pool_ = pool;
    }
  }
  if (stopped) {
    Drop(std::move(dropped), absl::UnavailableError("kvpoold is shutting down"));
    return;
  }
  Drop(std::move(dropped), absl::OkStatus());
  Run(pool, std::move(step));
}

bool StepRunner::MayRunHere(int32_t pool) const {
  if (stepping_) return false;
  for (size_t p = 0; p < schedulers_.size(); ++p) {
    if (static_cast<int32_t>(p) != pool && !schedulers_[p].empty()) return false;
  }
  return !batching_ || gather_window_ns_ <= 0 || schedulers_[static_cast<size_t>(pool)].Gathered();
}

void StepRunner::SessionEnded(SessionId session) {
  std::vector<std::unique_ptr<ComputeCall>> dropped;
  {
    absl::MutexLock lock(&mu_);
    dropped = RemoveIf([session](const ComputeCall& call) { return call.session().id == session; });
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
    dropped = RemoveIf([](const ComputeCall&) { return true; });
  }
  Drop(std::move(dropped), absl::UnavailableError("kvpoold is shutting down"));
  if (thread_.joinable()) thread_.join();
  // A step that SubmitOrRun's caller runs finishes too.
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](bool* stepping) { return !*stepping; }, &stepping_));
}

uint64_t StepRunner::steps() const {
  absl::MutexLock lock(&mu_);
  return steps_;
}

void StepRunner::Drop(std::vector<std::unique_ptr<ComputeCall>> calls, const absl::Status& status) {
  for (std::unique_ptr<ComputeCall>& call : calls) {
    // A prefill between chunks gives its sequence back.
    executor_->Abandon(*call, status.ok() ? call->context().Check() : status);
    call->Complete();
  }
}

std::vector<std::unique_ptr<ComputeCall>> StepRunner::RemoveIf(
    absl::FunctionRef<bool(const ComputeCall&)> drop) {
  std::vector<std::unique_ptr<ComputeCall>> out;
  for (StepScheduler& scheduler : schedulers_) {
    for (std::unique_ptr<ComputeCall>& call : scheduler.RemoveIf(drop)) {
      out.push_back(std::move(call));
    }
  }
  return out;
}

int32_t StepRunner::NextPool() const {
  const int32_t n = static_cast<int32_t>(schedulers_.size());
  for (int32_t k = 1; k <= n; ++k) {
    const int32_t p = (last_pool_ + k) % n;
    if (!schedulers_[static_cast<size_t>(p)].empty()) return p;
  }
  return -1;
}

bool StepRunner::NextStep(int32_t* pool, std::vector<std::unique_ptr<ComputeCall>>* step,
                          std::vector<std::unique_ptr<ComputeCall>>* dropped) {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](StepRunner* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return r->stop_ || (!r->stepping_ && r->NextPool() >= 0);
      },
      this));
  if (stop_) return false;
  stepping_ = true;  // SubmitOrRun queues from here on, for this thread to take
  *pool = NextPool();
  StepScheduler& scheduler = schedulers_[static_cast<size_t>(*pool)];
  if (batching_ && gather_window_ns_ > 0) {
    // The window opens when the call arrived or the runner came free, whichever is later: calls
    // that queued during a long step would otherwise find it closed already.
    const int64_t deadline =
        std::max(scheduler.oldest_arrival(), last_step_end_ns_) + gather_window_ns_;
    struct Waiting {
      StepRunner* runner;
      const StepScheduler* scheduler;
    } waiting{this, &scheduler};
    clock_->AwaitUntil(mu_,
                       absl::Condition(
                           +[](Waiting* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                             return w->runner->stop_ || w->scheduler->Gathered();
                           },
                           &waiting),
                       deadline);
    if (stop_) {
      stepping_ = false;
      return false;
    }
  }
  // Callers that gave up while queued leave before anything is planned for them.
  *dropped = RemoveIf([](const ComputeCall& call) { return !call.context().Check().ok(); });
  *step = scheduler.TakeStep();
  last_pool_ = *pool;
  return true;
}

void StepRunner::Loop() {
  for (;;) {
    int32_t pool = 0;
    std::vector<std::unique_ptr<ComputeCall>> step, dropped;
    if (!NextStep(&pool, &step, &dropped)) return;
    Drop(std::move(dropped), absl::OkStatus());
    Run(pool, std::move(step));
  }
}

void StepRunner::Run(int32_t pool, std::vector<std::unique_ptr<ComputeCall>> step) {
  if (step.empty()) {
    absl::MutexLock lock(&mu_);
    stepping_ = false;
    return;
  }
  std::vector<ComputeCall*> calls;
  calls.reserve(step.size());
  for (const auto& call : step) calls.push_back(call.get());
  executor_->RunStep(pool, calls);
  AfterStep(pool, std::move(step));
}

void StepRunner::AfterStep(int32_t pool, std::vector<std::unique_ptr<ComputeCall>> step) {
  std::vector<std::unique_ptr<ComputeCall>> finished, stopped;
  {
    absl::MutexLock lock(&mu_);
    stepping_ = false;
    last_step_end_ns_ = clock_->NowNanos();
    ++steps_;
    // The next chunks go in the next step, ahead of everything queued meanwhile.
    for (auto it = step.rbegin(); it != step.rend(); ++it) {
      if (!(*it)->unfinished()) {
        finished.push_back(std::move(*it));
      } else if (stop_) {
        stopped.push_back(std::move(*it));
      } else {
        schedulers_[static_cast<size_t>(pool)].PushFront(std::move(*it));
      }
    }
  }
  for (auto it = finished.rbegin(); it != finished.rend(); ++it) (*it)->Complete();
  Drop(std::move(stopped), absl::UnavailableError("kvpoold is shutting down"));
}

}  // namespace kvpool::daemon

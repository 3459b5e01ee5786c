#include "daemon/engine/step_scheduler.h"

#include <algorithm>

namespace kvpool::daemon {

StepScheduler::StepScheduler(const SchedulerOptions& options)
    : options_(options),
      share_(options.prefill_share > 0 ? options.prefill_share
                                       : std::max<int64_t>(1, options.max_step_tokens / 4)) {}

void StepScheduler::Count(const ComputeCall& call, int delta) {
  const SessionId s = call.session().id;
  if ((queued_[s] += delta) == 0) queued_.erase(s);
}

void StepScheduler::Push(std::unique_ptr<ComputeCall> call) {
  Count(*call, +1);
  queue_.push_back(std::move(call));
}

void StepScheduler::PushFront(std::unique_ptr<ComputeCall> call) {
  Count(*call, +1);
  queue_.push_front(std::move(call));
}

int64_t StepScheduler::oldest_arrival() const {
  int64_t oldest = queue_.front()->arrived_ns;
  for (const auto& call : queue_) oldest = std::min(oldest, call->arrived_ns);
  return oldest;
}

bool StepScheduler::Gathered() const {
  // Decodes alone can fill a step; prompt tokens cannot, since a prefill is chunked to what the
  // decodes leave: a long prompt in the queue is no reason to start without the decoders.
  int64_t tokens = 0;
  for (const auto& call : queue_) {
    if (!call->request().prefill()) tokens += call->step_tokens();
  }
  if (tokens >= options_.max_step_tokens) return true;
  for (SessionId s : expected_) {
    if (!queued_.contains(s)) return false;
  }
  return true;
}

std::vector<bool> StepScheduler::Choose() const {
  std::vector<bool> take(queue_.size(), false);
  if (!options_.batching) {
    take[0] = !queue_.empty();  // prefills between chunks are at the front
    return take;
  }
  // Prefills under way and aged ones join first; decodes then leave them their share.
  int64_t prefill_wants = 0;
  for (size_t i = 0; i < queue_.size(); ++i) {
    if (queue_[i]->progress() != nullptr || aged(*queue_[i])) {
      take[i] = true;
      prefill_wants += queue_[i]->step_tokens();
    }
  }
  const int64_t reserve = std::min(prefill_wants, share_);
  int64_t decode_tokens = 0;
  bool any_decode = false;
  for (size_t i = 0; i < queue_.size(); ++i) {
    const ComputeCall& call = *queue_[i];
    if (call.request().prefill()) continue;
    const int64_t w = call.step_tokens();
    if (any_decode && decode_tokens + w > options_.max_step_tokens - reserve) break;
    take[i] = any_decode = true;
    decode_tokens += w;
  }
  int64_t tokens = decode_tokens + prefill_wants;
  bool any = any_decode || prefill_wants > 0;
  for (size_t i = 0; i < queue_.size(); ++i) {
    const ComputeCall& call = *queue_[i];
    if (take[i] || !call.request().prefill()) continue;
    if (any && tokens >= options_.max_step_tokens) break;
    take[i] = any = true;
    tokens += call.step_tokens();  // an upper bound: its chunk may be smaller
  }
  return take;
}

std::vector<std::unique_ptr<ComputeCall>> StepScheduler::TakeStep() {
  if (queue_.empty()) return {};
  const std::vector<bool> take = Choose();
  int64_t left = options_.max_step_tokens;
  for (size_t i = 0; i < queue_.size(); ++i) {
    if (take[i] && !queue_[i]->request().prefill()) left -= queue_[i]->step_tokens();
  }
  std::vector<std::unique_ptr<ComputeCall>> step;
  std::deque<std::unique_ptr<ComputeCall>> rest;
  for (size_t i = 0; i < queue_.size(); ++i) {
    std::unique_ptr<ComputeCall>& call = queue_[i];
    if (!take[i]) {
      if (call->request().prefill() && call->progress() == nullptr) ++call->passed_over;
      rest.push_back(std::move(call));
      continue;
    }
    if (call->request().prefill()) {
      // Prefills take what the decodes left, in queue order (under way and aged first, since
      // they are at the front or oldest); each at least one token.
      call->chunk = std::max<int64_t>(1, left);
      left -= std::min(call->chunk, call->step_tokens());
    }
    Count(*call, -1);
    step.push_back(std::move(call));
  }
  queue_.swap(rest);
  // Prefills under way first: the step re-checks their sequences before planning anything else.
  std::stable_partition(step.begin(), step.end(),
                        [](const auto& c) { return c->progress() != nullptr; });
  // Everyone in this step is expected in the next: a decoding session decodes again, a session
  // that prefilled starts decoding.
  expected_.clear();
  for (const auto& call : step) expected_.insert(call->session().id);
  return step;
}

std::vector<std::unique_ptr<ComputeCall>> StepScheduler::RemoveIf(
    absl::FunctionRef<bool(const ComputeCall&)> drop) {
  std::vector<std::unique_ptr<ComputeCall>> dropped;
  std::deque<std::unique_ptr<ComputeCall>> rest;
  for (std::unique_ptr<ComputeCall>& call : queue_) {
    if (drop(*call)) {
      Count(*call, -1);
      dropped.push_back(std::move(call));
    } else {
      rest.push_back(std::move(call));
    }
  }
  queue_.swap(rest);
  return dropped;
}

}  // namespace kvpool::daemon

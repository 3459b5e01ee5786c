#include "kvpool/kv_events.h"

#include <utility>

#include "kvpool/util/check.h"

namespace kvpool {

EventLog::EventLog(uint64_t epoch, size_t capacity) : epoch_(epoch), capacity_(capacity) {
  KVPOOL_CHECK(capacity_ > 0);
}

void EventLog::Append(KvEvent event) {
  event.seq = next_seq_++;
  event.epoch = epoch_;
  if (ring_.size() == capacity_) ring_.pop_front();
  ring_.push_back(std::move(event));
}

bool EventLog::ReadFrom(uint64_t from, size_t max, std::vector<KvEvent>* out) const {
  if (from < oldest_seq()) return false;
  if (from >= next_seq_) return true;
  const size_t start = static_cast<size_t>(from - oldest_seq());
  for (size_t i = start; i < ring_.size() && max > 0; ++i, --max) out->push_back(ring_[i]);
  return true;
}

}  // namespace kvpool

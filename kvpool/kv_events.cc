#include "kvpool/kv_events.h"

#include <utility>

#include "kvpool/util/check.h"

namespace kvpool {

std::string_view GroupKindName(KvGroupKind kind) {
  switch (kind) {
    case KvGroupKind::kFullAttention:
      return "full_attention";
    case KvGroupKind::kSlidingWindow:
      return "sliding_window";
    case KvGroupKind::kStateSpace:
      return "mamba";
  }
  return "unknown";
}

size_t EventBytes(const KvEvent& event) {
  return sizeof(KvEvent) + event.block_hashes.capacity() * sizeof(BlockHash) +
         event.token_ids.capacity() * sizeof(int32_t);
}

EventLog::EventLog(uint64_t epoch, size_t capacity, size_t max_bytes)
    : epoch_(epoch), capacity_(capacity), max_bytes_(max_bytes) {
  KVPOOL_CHECK(capacity_ > 0);
  KVPOOL_CHECK(max_bytes_ > 0);
}

void EventLog::Append(KvEvent event) {
  event.seq = next_seq_++;
  event.epoch = epoch_;
  ring_.push_back(std::move(event));
  bytes_ += EventBytes(ring_.back());  // after the move: the buffers it holds now
  DropPastBounds();
}

void EventLog::set_max_bytes(size_t max_bytes) {
  KVPOOL_CHECK(max_bytes > 0);
  max_bytes_ = max_bytes;
  DropPastBounds();
}

void EventLog::DropPastBounds() {
  while (!ring_.empty() && (ring_.size() > capacity_ || bytes_ > max_bytes_)) {
    bytes_ -= EventBytes(ring_.front());
    ring_.pop_front();
    ++dropped_;
  }
}

bool EventLog::ReadFrom(uint64_t from, size_t max, std::vector<KvEvent>* out) const {
  if (from < oldest_seq()) return false;
  if (from >= next_seq_) return true;
  const size_t start = static_cast<size_t>(from - oldest_seq());
  for (size_t i = start; i < ring_.size() && max > 0; ++i, --max) out->push_back(ring_[i]);
  return true;
}

}  // namespace kvpool

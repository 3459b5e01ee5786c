#include "kvpool/kv_events.h"

#include <algorithm>
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

void TierEventView::Apply(const KvEvent& event) {
  KVPOOL_CHECK(event.medium != KvMedium::kDevice);
  if (event.type == KvEventType::kAllBlocksCleared) {
    for (auto it = groups_.begin(); it != groups_.end();) {
      if (it->first.first != event.medium) {
        ++it;
        continue;
      }
      size_ -= it->second.blocks.size();
      it = groups_.erase(it);
    }
    return;
  }
  const int32_t index = event.group ? event.group->index : 0;
  Group& g = groups_[{event.medium, index}];
  g.group = event.group;
  g.block_size = event.block_size;
  BlockHash parent = event.parent_hash.value_or(BlockHash{});
  for (const BlockHash& hash : event.block_hashes) {
    if (event.type == KvEventType::kBlockStored) {
      const auto [it, inserted] =
          g.blocks.try_emplace(hash, Held{.ns = event.ns, .parent = parent, .order = next_order_});
      if (inserted) {
        ++next_order_;
        ++size_;
      }
      parent = hash;  // a Stored event's blocks are each the parent of the next
    } else {
      size_ -= g.blocks.erase(hash);
    }
  }
}

void TierEventView::AppendSnapshot(std::vector<KvEvent>* out) const {
  using Entry = std::pair<const BlockHash, Held>;
  std::vector<const Entry*> told;
  absl::flat_hash_map<BlockHash, std::vector<const Entry*>> children;
  std::vector<const Entry*> starts;  // a stack of blocks that start an event
  for (const auto& [key, g] : groups_) {
    told.clear();
    children.clear();
    for (const Entry& b : g.blocks) told.push_back(&b);
    std::sort(told.begin(), told.end(),
              [](const Entry* a, const Entry* b) { return a->second.order < b->second.order; });
    // A block whose parent is held here goes after it; the others are roots, in told order.
    for (auto it = told.rbegin(); it != told.rend(); ++it) {
      const Held& h = (*it)->second;
      const auto parent = g.blocks.find(h.parent);
      if (h.parent != BlockHash{} && h.parent != (*it)->first && parent != g.blocks.end() &&
          parent->second.ns == h.ns) {
        children[h.parent].push_back(*it);  // latest told first: popped last
      } else {
        starts.push_back(*it);
      }
    }
    // Each start begins an event and follows its first child, and that one's, on the same
    // event; the other children start events of their own, after it.
    while (!starts.empty()) {
      const Entry* b = starts.back();
      starts.pop_back();
      KvEvent e{.type = KvEventType::kBlockStored,
                .ns = b->second.ns,
                .block_hashes = {b->first},
                .block_size = g.block_size,
                .medium = key.first,
                .group = g.group};
      if (b->second.parent != BlockHash{}) e.parent_hash = b->second.parent;
      for (auto kids = children.find(b->first); kids != children.end();
           kids = children.find(e.block_hashes.back())) {
        std::vector<const Entry*>& next = kids->second;
        e.block_hashes.push_back(next.back()->first);
        next.pop_back();
        starts.insert(starts.end(), next.begin(), next.end());
        children.erase(kids);
      }
      out->push_back(std::move(e));
    }
  }
}

}  // namespace kvpool

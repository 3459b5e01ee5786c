#include "kvpool/kv_events.h"

#include <optional>
#include <utility>

#include "kvpool/util/check.h"
#include "kvpool/util/parents_first.h"

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
      size_ -= it->second.held.size();
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
      if (g.held.try_emplace(hash, g.told.size()).second) {
        g.told.push_back({.hash = hash, .parent = parent, .ns = event.ns});
        ++size_;
      }
      parent = hash;  // a Stored event's blocks are each the parent of the next
    } else if (const auto it = g.held.find(hash); it != g.held.end()) {
      g.told[it->second].held = false;
      g.held.erase(it);
      --size_;
    }
  }
  if (g.told.size() > 1024 && g.told.size() > 2 * g.held.size()) Compact(g);
}

void TierEventView::Compact(Group& g) {
  size_t kept = 0;
  for (const Told& t : g.told) {
    if (!t.held) continue;
    g.held[t.hash] = kept;
    g.told[kept++] = t;
  }
  g.told.resize(kept);
}

void TierEventView::AppendSnapshot(std::vector<KvEvent>* out) const {
  for (const auto& [key, g] : groups_) {
    // The entry of `i`'s parent when that is held here; none otherwise. Told right after its
    // parent (a chain stored at once), a block needs no lookup.
    const auto parent = [&g](size_t i) -> std::optional<size_t> {
      const Told& t = g.told[i];
      if (t.parent == BlockHash{}) return std::nullopt;
      if (i > 0 && g.told[i - 1].held && g.told[i - 1].hash == t.parent &&
          g.told[i - 1].ns == t.ns) {
        return i - 1;
      }
      const auto p = g.held.find(t.parent);
      if (p == g.held.end() || g.told[p->second].ns != t.ns) return std::nullopt;
      return p->second;
    };
    const size_t first = out->size();
    VisitParentsFirst(
        g.told.size(), [&g](size_t i) { return g.told[i].held; }, parent,
        [&](size_t i) {
          const Told& t = g.told[i];
          if (out->size() > first) {
            KvEvent& last = out->back();
            if (last.ns == t.ns && last.block_hashes.back() == t.parent) {
              last.block_hashes.push_back(t.hash);
              return;
            }
          }
          KvEvent e{.type = KvEventType::kBlockStored,
                    .ns = t.ns,
                    .block_hashes = {t.hash},
                    .block_size = g.block_size,
                    .medium = key.first,
                    .group = g.group};
          if (t.parent != BlockHash{}) e.parent_hash = t.parent;
          out->push_back(std::move(e));
        });
  }
}

}  // namespace kvpool

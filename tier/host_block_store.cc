#include "tier/host_block_store.h"

#include <cstring>
#include <new>
#include <optional>

#include "absl/strings/str_cat.h"
#include "tier/internal/slot_lru.h"

namespace kvpool::tier {

namespace {

absl::Status CheckSizes(int64_t blocks, int64_t block_bytes) {
  if (blocks <= 0 || block_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("host tier: ", blocks, " blocks of ", block_bytes, " bytes"));
  }
  if (blocks > (int64_t{1} << 46) / block_bytes || blocks > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("host tier: ", blocks, " blocks of ", block_bytes, " bytes is too large"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostBlockStore>> HostBlockStore::Create(int64_t blocks,
                                                                       int64_t block_bytes) {
  if (absl::Status s = CheckSizes(blocks, block_bytes); !s.ok()) return s;
  std::unique_ptr<std::byte[]> arena(new (std::nothrow)
                                         std::byte[static_cast<size_t>(blocks * block_bytes)]);
  if (arena == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host tier: cannot allocate ", blocks * block_bytes, " bytes"));
  }
  std::byte* base = arena.get();
  return std::unique_ptr<HostBlockStore>(
      new HostBlockStore(blocks, block_bytes, base, std::move(arena)));
}

absl::StatusOr<std::unique_ptr<HostBlockStore>> HostBlockStore::Create(int64_t blocks,
                                                                       int64_t block_bytes,
                                                                       std::byte* memory) {
  if (absl::Status s = CheckSizes(blocks, block_bytes); !s.ok()) return s;
  if (memory == nullptr) return absl::InvalidArgumentError("host tier: no memory");
  return std::unique_ptr<HostBlockStore>(new HostBlockStore(blocks, block_bytes, memory, nullptr));
}

HostBlockStore::HostBlockStore(int64_t blocks, int64_t block_bytes, std::byte* arena,
                               std::unique_ptr<std::byte[]> owned)
    : capacity_(blocks), block_bytes_(block_bytes), arena_(arena), owned_(std::move(owned)) {
  slots_.resize(static_cast<size_t>(blocks));
  index_.reserve(static_cast<size_t>(blocks));
}

void HostBlockStore::Unlink(int32_t slot) { internal::UnlinkSlot(slots_, head_, tail_, slot); }

void HostBlockStore::PushFront(int32_t slot) {
  internal::PushFrontSlot(slots_, head_, tail_, slot);
}

bool HostBlockStore::Put(const BlockSpace& space, const BlockToStore& block) {
  bool stored = false;
  std::optional<Key> dropped;
  {
    absl::MutexLock lock(&mu_);
    ++stats_.puts;
    if (static_cast<int64_t>(block.bytes.size()) != block_bytes_) {
      ++stats_.dropped_write_errors;
      return false;
    }
    const Key key{space.ns.value(), space.layout_fingerprint, block.hash};
    if (auto it = index_.find(key); it != index_.end()) {
      ++stats_.already_present;
      Unlink(it->second);
      PushFront(it->second);
      return true;
    }
    int32_t slot;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else if (unused_ < capacity_) {
      slot = unused_++;
    } else {
      slot = tail_;  // the least recently used block makes room
      Unlink(slot);
      dropped = slots_[static_cast<size_t>(slot)].key;
      index_.erase(*dropped);
      ++evicted_;
    }
    Slot& s = slots_[static_cast<size_t>(slot)];
    s.key = key;
    s.parent = block.parent;
    s.coverage = block.coverage;
    s.tags = block.tags;
    s.used = true;
    std::memcpy(SlotBytes(slot), block.bytes.data(), block.bytes.size());
    index_.emplace(key, slot);
    PushFront(slot);
    ++stats_.written;
    stats_.bytes_written += static_cast<uint64_t>(block_bytes_);
    stored = true;
  }
  if (listener_) {
    if (dropped) {
      listener_({NamespaceId(dropped->ns), dropped->layout}, dropped->hash, BlockHash{}, false);
    }
    if (stored) listener_(space, block.hash, block.parent, true);
  }
  return true;
}

LookupResult HostBlockStore::LookupChecked(const BlockSpace& space, const BlockHash& parent,
                                           std::span<const BlockHash> hashes,
                                           std::span<const std::span<std::byte>> out) {
  LookupResult result;
  absl::MutexLock lock(&mu_);
  ++stats_.lookups;
  const BlockHash* want_parent = &parent;
  for (size_t i = 0; i < hashes.size(); ++i) {
    const auto it = index_.find(Key{space.ns.value(), space.layout_fingerprint, hashes[i]});
    if (it == index_.end()) break;
    const Slot& s = slots_[static_cast<size_t>(it->second)];
    if (s.parent != *want_parent || static_cast<int64_t>(out[i].size()) != block_bytes_) {
      ++stats_.corrupt;  // another chain under this hash, or a buffer of the wrong size
      break;
    }
    std::memcpy(out[i].data(), SlotBytes(it->second), static_cast<size_t>(block_bytes_));
    Unlink(it->second);
    PushFront(it->second);
    result.coverage.push_back(s.coverage);
    ++result.hits;
    want_parent = &hashes[i];
  }
  stats_.hits += static_cast<uint64_t>(result.hits);
  stats_.misses += hashes.size() - static_cast<size_t>(result.hits);
  stats_.bytes_read += static_cast<uint64_t>(result.hits * block_bytes_);
  return result;
}

int64_t HostBlockStore::Invalidate(const TagFilter& filter) {
  std::vector<Key> dropped;
  {
    absl::MutexLock lock(&mu_);
    for (int32_t slot = 0; slot < unused_; ++slot) {
      Slot& s = slots_[static_cast<size_t>(slot)];
      if (!s.used || !filter.Matches(s.tags)) continue;
      Unlink(slot);
      index_.erase(s.key);
      dropped.push_back(s.key);
      s.used = false;
      free_.push_back(slot);
    }
  }
  if (listener_) {
    for (const Key& k : dropped) {
      listener_({NamespaceId(k.ns), k.layout}, k.hash, BlockHash{}, false);
    }
  }
  return static_cast<int64_t>(dropped.size());
}

RemoteTierStats HostBlockStore::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

uint64_t HostBlockStore::evicted() const {
  absl::MutexLock lock(&mu_);
  return evicted_;
}

int64_t HostBlockStore::stored() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(index_.size());
}

}  // namespace kvpool::tier

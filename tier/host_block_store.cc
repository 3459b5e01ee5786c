#include "tier/host_block_store.h"

#include <cstring>
#include <new>
#include <optional>

#include "absl/strings/str_cat.h"
#include "kvpool/util/check.h"

namespace kvpool::tier {

namespace {

absl::Status CheckSizes(int64_t blocks, int64_t block_bytes, int32_t max_shares) {
  if (max_shares < 0) {
    return absl::InvalidArgumentError(absl::StrCat("host tier: ", max_shares, " tenant shares"));
  }
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
                                                                       int64_t block_bytes,
                                                                       int32_t max_shares) {
  if (absl::Status s = CheckSizes(blocks, block_bytes, max_shares); !s.ok()) return s;
  std::unique_ptr<std::byte[]> arena(new (std::nothrow)
                                         std::byte[static_cast<size_t>(blocks * block_bytes)]);
  if (arena == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host tier: cannot allocate ", blocks * block_bytes, " bytes"));
  }
  std::byte* base = arena.get();
  return std::unique_ptr<HostBlockStore>(
      new HostBlockStore(blocks, block_bytes, base, std::move(arena), max_shares));
}

absl::StatusOr<std::unique_ptr<HostBlockStore>> HostBlockStore::Create(int64_t blocks,
                                                                       int64_t block_bytes,
                                                                       std::byte* memory,
                                                                       int32_t max_shares) {
  if (absl::Status s = CheckSizes(blocks, block_bytes, max_shares); !s.ok()) return s;
  if (memory == nullptr) return absl::InvalidArgumentError("host tier: no memory");
  return std::unique_ptr<HostBlockStore>(
      new HostBlockStore(blocks, block_bytes, memory, nullptr, max_shares));
}

HostBlockStore::HostBlockStore(int64_t blocks, int64_t block_bytes, std::byte* arena,
                               std::unique_ptr<std::byte[]> owned, int32_t max_shares)
    : capacity_(blocks),
      block_bytes_(block_bytes),
      arena_(arena),
      owned_(std::move(owned)),
      lru_(blocks, max_shares) {
  slots_.resize(static_cast<size_t>(blocks));
  index_.reserve(static_cast<size_t>(blocks));
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
      if (slots_[static_cast<size_t>(it->second)].pins == 0) {  // a pinned one is out of the list
        lru_.Touch(it->second);
      }
      return true;
    }
    const int32_t slot = TakeSlot(&dropped);
    if (slot < 0) {
      ++stats_.dropped_queue_full;  // every slot is pinned by a promotion's copy
      return false;
    }
    Slot& s = slots_[static_cast<size_t>(slot)];
    s.key = key;
    s.parent = block.parent;
    s.coverage = block.coverage;
    s.tags = block.tags;
    s.used = true;
    std::memcpy(SlotBytes(slot), block.bytes.data(), block.bytes.size());
    index_.emplace(key, slot);
    lru_.Add(slot, lru_.ShareOf(block.tags.tenant));
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

int32_t HostBlockStore::TakeSlot(std::optional<Key>* dropped) {
  if (!free_.empty()) {
    const int32_t slot = free_.back();
    free_.pop_back();
    return slot;
  }
  if (unused_ < capacity_) return unused_++;
  // The least recently used block of the share most over its weight makes room. Pinned slots
  // are not in the lists: never taken.
  const int32_t slot = lru_.Victim();
  if (slot < 0) return -1;
  lru_.CountEviction(slot);
  lru_.Remove(slot);
  *dropped = slots_[static_cast<size_t>(slot)].key;
  index_.erase(**dropped);
  ++evicted_;
  return slot;
}

int32_t HostBlockStore::FindInChain(const BlockSpace& space, const BlockHash& parent,
                                    const BlockHash& hash, int32_t previous) {
  const Key key{space.ns.value(), space.layout_fingerprint, hash};
  // A chain stored at once sits in consecutive slots: the slot after the previous block's is
  // read before the index (a used slot is the one its key is indexed to), which spares a long
  // promotion one cold hash probe per block.
  if (const size_t next = static_cast<size_t>(previous) + 1;
      previous >= 0 && next < slots_.size()) {
    const Slot& s = slots_[next];
    if (s.used && s.key == key && s.parent == parent) return static_cast<int32_t>(next);
  }
  const auto it = index_.find(key);
  if (it == index_.end()) return -1;
  if (slots_[static_cast<size_t>(it->second)].parent != parent) {
    ++stats_.corrupt;  // another chain under this hash
    return -1;
  }
  return it->second;
}

LookupResult HostBlockStore::LookupChecked(const BlockSpace& space, const BlockHash& parent,
                                           std::span<const BlockHash> hashes,
                                           std::span<const std::span<std::byte>> out) {
  LookupResult result;
  absl::MutexLock lock(&mu_);
  ++stats_.lookups;
  const BlockHash* want_parent = &parent;
  int32_t previous = -1;
  for (size_t i = 0; i < hashes.size(); ++i) {
    const int32_t slot = FindInChain(space, *want_parent, hashes[i], previous);
    if (slot < 0) break;
    previous = slot;
    if (static_cast<int64_t>(out[i].size()) != block_bytes_) {
      ++stats_.corrupt;  // a buffer of the wrong size
      break;
    }
    const Slot& s = slots_[static_cast<size_t>(slot)];
    std::memcpy(out[i].data(), SlotBytes(slot), static_cast<size_t>(block_bytes_));
    if (s.pins == 0) {  // a pinned slot is out of the list until its last pin goes
      lru_.Touch(slot);
    }
    result.coverage.push_back(s.coverage);
    ++result.hits;
    want_parent = &hashes[i];
  }
  stats_.hits += static_cast<uint64_t>(result.hits);
  stats_.misses += hashes.size() - static_cast<size_t>(result.hits);
  stats_.bytes_read += static_cast<uint64_t>(result.hits * block_bytes_);
  return result;
}

HostBlockStore::Pins HostBlockStore::LookupPinned(const BlockSpace& space, const BlockHash& parent,
                                                  std::span<const BlockHash> hashes) {
  Pins pins;
  pins.store_ = this;
  absl::MutexLock lock(&mu_);
  if (hashes.empty()) return pins;
  ++stats_.lookups;
  const BlockHash* want_parent = &parent;
  int32_t previous = -1;
  for (size_t i = 0; i < hashes.size(); ++i) {
    const int32_t slot = FindInChain(space, *want_parent, hashes[i], previous);
    if (slot < 0) break;
    previous = slot;
    Slot& s = slots_[static_cast<size_t>(slot)];
    if (s.pins++ == 0) {
      lru_.Unlink(slot);  // out of the LRU list: nothing evicts it while pinned
      ++pinned_;
    }
    pins.slots_.push_back(slot);
    want_parent = &hashes[i];
  }
  const int64_t hits = pins.size();
  stats_.hits += static_cast<uint64_t>(hits);
  stats_.misses += hashes.size() - static_cast<size_t>(hits);
  stats_.bytes_read += static_cast<uint64_t>(hits * block_bytes_);
  return pins;
}

void HostBlockStore::Unpin(std::span<const int32_t> slots) {
  absl::MutexLock lock(&mu_);
  for (const int32_t slot : slots) {
    Slot& s = slots_[static_cast<size_t>(slot)];
    KVPOOL_CHECK_MSG(s.pins > 0, "host tier: a slot unpinned more often than pinned");
    if (--s.pins > 0) continue;
    --pinned_;
    if (s.used) {
      lru_.Relink(slot);  // just read: the most recently used
    } else {
      free_.push_back(slot);  // invalidated while pinned: free only now
    }
  }
}

HostBlockStore::Pins& HostBlockStore::Pins::operator=(Pins&& other) noexcept {
  if (this != &other) {
    Release();
    store_ = std::exchange(other.store_, nullptr);
    slots_ = std::move(other.slots_);
  }
  return *this;
}

std::span<const std::byte> HostBlockStore::Pins::block(size_t i) const {
  KVPOOL_CHECK_MSG(i < slots_.size(), "host tier: pinned block index out of range");
  return {store_->SlotBytes(slots_[i]), static_cast<size_t>(store_->block_bytes_)};
}

void HostBlockStore::Pins::Release() {
  if (store_ != nullptr && !slots_.empty()) store_->Unpin(slots_);
  slots_.clear();
}

int64_t HostBlockStore::Invalidate(const TagFilter& filter) {
  std::vector<Key> dropped;
  {
    absl::MutexLock lock(&mu_);
    for (int32_t slot = 0; slot < unused_; ++slot) {
      Slot& s = slots_[static_cast<size_t>(slot)];
      if (!s.used || !filter.Matches(s.tags)) continue;
      index_.erase(s.key);
      dropped.push_back(s.key);
      s.used = false;
      lru_.Remove(slot);
      if (s.pins > 0) continue;  // freed by its last unpin
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

int64_t HostBlockStore::pinned() const {
  absl::MutexLock lock(&mu_);
  return pinned_;
}

absl::Status HostBlockStore::SetTenantWeight(uint64_t tenant, int32_t weight) {
  absl::MutexLock lock(&mu_);
  return lru_.SetWeight(tenant, weight);
}

int64_t HostBlockStore::stored_by(uint64_t tenant) const {
  absl::MutexLock lock(&mu_);
  return lru_.used_by(tenant);
}

uint64_t HostBlockStore::evicted_from(uint64_t tenant) const {
  absl::MutexLock lock(&mu_);
  return lru_.evicted_from(tenant);
}

absl::Status HostBlockStore::CheckInvariants() const {
  absl::MutexLock lock(&mu_);
  int64_t used = 0;
  for (int32_t slot = 0; slot < unused_; ++slot) {
    const Slot& s = slots_[static_cast<size_t>(slot)];
    used += s.used ? 1 : 0;
    if (const auto it = index_.find(s.key); s.used && (it == index_.end() || it->second != slot)) {
      return absl::InternalError(
          absl::StrCat("host tier: used slot ", slot, " is not where its key is indexed"));
    }
    if (s.used != (lru_.share_of_slot(slot) >= 0)) {
      return absl::InternalError(absl::StrCat("host tier: slot ", slot, " used ", s.used,
                                              " but in share ", lru_.share_of_slot(slot)));
    }
  }
  if (used != static_cast<int64_t>(index_.size())) {
    return absl::InternalError(
        absl::StrCat("host tier: ", used, " used slots, ", index_.size(), " indexed"));
  }
  return lru_.CheckInvariants();
}

int64_t HostBlockStore::stored() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(index_.size());
}

}  // namespace kvpool::tier

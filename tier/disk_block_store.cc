#include "tier/disk_block_store.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/parents_first.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::tier {
namespace {

// Index positions of `slots` (some -1: not written) in slot order, split into runs of adjacent
// slots: each run is one preadv / pwritev.
std::vector<std::vector<size_t>> Runs(const std::vector<int32_t>& slots) {
  std::vector<size_t> order;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] >= 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return slots[a] < slots[b]; });
  std::vector<std::vector<size_t>> runs;
  for (size_t i : order) {
    if (runs.empty() || slots[runs.back().back()] + 1 != slots[i]) runs.emplace_back();
    runs.back().push_back(i);
  }
  return runs;
}

}  // namespace

DiskBlockStore::DiskBlockStore(const DiskTierOptions& options, const DeploymentSecret& secret,
                               uint64_t layout_fingerprint, int64_t block_bytes, int64_t slots,
                               Files files, const Clock* clock)
    : options_(options),
      secret_(secret),
      layout_fingerprint_(layout_fingerprint),
      block_bytes_(block_bytes),
      slot_bytes_(AlignUp(block_bytes)),
      slots_count_(slots),
      files_(std::move(files)),
      clock_(clock),
      breaker_({.failure_threshold = options.breaker_failure_threshold,
                .backoff = options.breaker_backoff,
                .max_backoff = options.breaker_max_backoff},
               clock),
      lru_(slots, options.tenant_shares) {
  slots_.resize(static_cast<size_t>(slots));
  index_.reserve(static_cast<size_t>(slots));
}

absl::Status DiskBlockStore::SetTenantWeight(uint64_t tenant, int32_t weight) {
  absl::MutexLock lock(&mu_);
  return lru_.SetWeight(tenant, weight);
}

int64_t DiskBlockStore::stored_by(uint64_t tenant) const {
  absl::MutexLock lock(&mu_);
  return lru_.used_by(tenant);
}

uint64_t DiskBlockStore::evicted_from(uint64_t tenant) const {
  absl::MutexLock lock(&mu_);
  return lru_.evicted_from(tenant);
}

DiskBlockStore::~DiskBlockStore() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
  }
  if (writer_.joinable()) writer_.join();
}

void DiskBlockStore::Tell(const std::vector<Change>& changes) const {
  if (!listener_) return;
  for (const Change& c : changes) {
    listener_({c.entry.ns, layout_fingerprint_}, c.entry.hash, c.entry.parent, c.stored);
  }
}

void DiskBlockStore::TellRecords() const {
  std::vector<Change> found;
  {
    absl::MutexLock lock(&mu_);
    for (const Slot& s : slots_) {
      if (s.state == SlotState::kStored) found.push_back({.entry = s.entry, .stored = true});
    }
  }
  // In the order written, but each record after its parent where that was found too (a slot's
  // place says nothing of it): a consumer that follows the events grows a tree from them.
  std::sort(found.begin(), found.end(),
            [](const Change& a, const Change& b) { return a.entry.sequence < b.entry.sequence; });
  absl::flat_hash_map<Key, size_t> at;
  for (size_t i = 0; i < found.size(); ++i) {
    at.emplace(Key{found[i].entry.ns.value(), found[i].entry.hash}, i);
  }
  std::vector<Change> changes;
  changes.reserve(found.size());
  VisitParentsFirst(
      found.size(), [](size_t) { return true; },
      [&](size_t i) -> std::optional<size_t> {
        const IndexEntry& e = found[i].entry;
        if (e.parent == BlockHash{}) return std::nullopt;
        const auto p = at.find(Key{e.ns.value(), e.parent});
        if (p == at.end()) return std::nullopt;
        return p->second;
      },
      [&](size_t i) { changes.push_back(found[i]); });
  Tell(changes);
}

void DiskBlockStore::DropStored(int32_t slot, std::vector<Change>* changes) {
  Slot& s = slots_[static_cast<size_t>(slot)];
  lru_.Remove(slot);
  index_.erase(Key{s.entry.ns.value(), s.entry.hash});
  changes->push_back({.entry = s.entry, .stored = false});
  s.state = SlotState::kFree;
  free_.push_back(slot);
  erase_.insert(slot);
}

int32_t DiskBlockStore::TakeSlot(uint64_t tenant, std::vector<Change>* changes) {
  int32_t slot = -1;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else if (const int32_t victim = lru_.Victim(); victim >= 0) {
    // The least recently used record of the tenant share most over its weight makes room.
    slot = victim;
    Slot& s = slots_[static_cast<size_t>(slot)];
    lru_.CountEviction(slot);
    lru_.Remove(slot);
    index_.erase(Key{s.entry.ns.value(), s.entry.hash});
    changes->push_back({.entry = s.entry, .stored = false});
    ++disk_.evicted;
  } else {
    return -1;
  }
  erase_.erase(slot);  // the new entry replaces whatever the old one said
  slots_[static_cast<size_t>(slot)].state = SlotState::kWriting;
  // Counted in its tenant's share while it is written (the batch's later slots are chosen
  // knowing it), but no candidate until it is stored.
  lru_.Add(slot, lru_.ShareOf(tenant));
  lru_.Unlink(slot);
  return slot;
}

bool DiskBlockStore::Put(const BlockSpace& space, const BlockToStore& block) {
  // Queued even while the breaker is open: the writer drops what it may not write (counted), and
  // a write after the back-off is the probe that closes the breaker again.
  const bool fits = space.layout_fingerprint == layout_fingerprint_ &&
                    static_cast<int64_t>(block.bytes.size()) == block_bytes_;
  absl::StatusOr<internal::AlignedBuffer> bytes = absl::InvalidArgumentError("wrong size");
  if (fits) bytes = internal::AlignedBuffer::Create(slot_bytes_);  // no lock held for either
  if (bytes.ok()) std::memcpy(bytes->data(), block.bytes.data(), block.bytes.size());
  absl::MutexLock lock(&mu_);
  ++counters_.puts;
  if (!bytes.ok()) {  // another layout's, a wrong size, or no memory
    ++counters_.dropped_write_errors;
    return false;
  }
  if (stopping_) {
    ++counters_.dropped_shutdown;
    return false;
  }
  if (static_cast<int64_t>(queue_.size()) >= options_.write_queue_blocks ||
      queued_bytes_ + slot_bytes_ > options_.write_queue_bytes) {
    ++counters_.dropped_queue_full;
    return false;
  }
  queue_.push_back({.entry = {.ns = space.ns,
                              .hash = block.hash,
                              .parent = block.parent,
                              .coverage = block.coverage,
                              .tags = block.tags},
                    .bytes = *std::move(bytes)});
  queued_bytes_ += slot_bytes_;
  ++enqueued_;
  changed_.Signal();
  return true;
}

void DiskBlockStore::WriterLoop() {
  for (;;) {
    std::vector<QueuedWrite> batch;
    std::vector<int32_t> erased;
    {
      absl::MutexLock lock(&mu_);
      while (queue_.empty() && erase_.empty() && !stopping_) changed_.Wait(&mu_);
      // Stopping too: what is queued is written, and the entries of dropped records are cleared
      // (an invalidated record must not come back after a restart).
      if (queue_.empty() && erase_.empty()) return;
      // Never more than there are slots: every record of a batch gets one.
      const int64_t most = std::min<int64_t>(options_.write_batch_blocks, slots_count_);
      while (!queue_.empty() && static_cast<int64_t>(batch.size()) < most) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
        queued_bytes_ -= slot_bytes_;
      }
      erased.assign(erase_.begin(), erase_.end());
      erase_.clear();
      erasing_ = static_cast<int64_t>(erased.size());
      std::sort(erased.begin(), erased.end());
      filters_in_batch_.clear();
    }
    WriteBatch(batch, erased);
  }
}

void DiskBlockStore::WriteBatch(std::vector<QueuedWrite>& batch,
                                const std::vector<int32_t>& erased) {
  if (!breaker_.Allow()) {
    absl::MutexLock lock(&mu_);
    counters_.dropped_breaker_open += batch.size();
    completed_ += static_cast<int64_t>(batch.size());
    erasing_ = 0;
    if (!stopping_) {
      erase_.insert(erased.begin(), erased.end());  // cleared once the disk takes writes again
    } else if (!erased.empty()) {
      Logger("tier").warn(
          "disk tier {}: stopping while the disk fails: the entries of {} dropped records could "
          "not be cleared, and a restart may find those records again",
          options_.directory, erased.size());
    }
    changed_.SignalAll();
    if (queue_.empty() && !stopping_) changed_.WaitWithTimeout(&mu_, options_.breaker_backoff);
    return;
  }
  size_t cleared = 0;
  absl::Status io = ClearEntries(erased, &cleared);
  std::vector<int32_t> slots(batch.size(), -1);
  std::vector<Change> changes;
  {
    absl::MutexLock lock(&mu_);
    // An entry left on disk would bring its dropped record back at the next Open: cleared once
    // the disk takes writes again, as when the breaker is open (the failure is counted, and told
    // to the breaker, by FinishBatch). Before this batch takes slots: one it takes leaves erase_.
    erase_.insert(erased.begin() + static_cast<ptrdiff_t>(cleared), erased.end());
    for (size_t i = 0; i < batch.size(); ++i) {
      IndexEntry& e = batch[i].entry;
      const bool present = index_.contains(Key{e.ns.value(), e.hash}) ||
                           std::any_of(batch.begin(), batch.begin() + static_cast<ptrdiff_t>(i),
                                       [&](const QueuedWrite& w) {
                                         return w.entry.ns == e.ns && w.entry.hash == e.hash;
                                       });
      if (present) {
        ++counters_.already_present;
        continue;
      }
      slots[i] = TakeSlot(e.tags.tenant, &changes);
      if (slots[i] < 0) ++counters_.dropped_write_errors;  // cannot happen: batch <= slots
      e.sequence = next_sequence_++;
    }
  }
  Tell(changes);
  changes.clear();
  for (size_t i = 0; i < batch.size(); ++i) {
    if (slots[i] < 0) continue;
    batch[i].entry.nonce = RandomValueNonce();
    SealEntry(secret_, layout_fingerprint_,
              batch[i].bytes.span().first(static_cast<size_t>(block_bytes_)), &batch[i].entry);
  }
  if (options_.writer_gap_hook) options_.writer_gap_hook();
  if (io.ok()) io = WriteRecords(batch, slots);
  FinishBatch(batch, slots, io, &changes);
  Tell(changes);
  // Only now: a Flush that returns has its records' events told.
  absl::MutexLock lock(&mu_);
  completed_ += static_cast<int64_t>(batch.size());
  erasing_ = 0;
  changed_.SignalAll();
}

void DiskBlockStore::FinishBatch(const std::vector<QueuedWrite>& batch,
                                 const std::vector<int32_t>& slots, const absl::Status& io,
                                 std::vector<Change>* changes) {
  io.ok() ? breaker_.OnSuccess() : breaker_.OnFailure();
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < batch.size(); ++i) {
    if (slots[i] < 0) continue;
    Slot& s = slots_[static_cast<size_t>(slots[i])];
    const IndexEntry& e = batch[i].entry;
    const bool invalidated = std::any_of(filters_in_batch_.begin(), filters_in_batch_.end(),
                                         [&](const TagFilter& f) { return f.Matches(e.tags); });
    if (!io.ok() || invalidated) {
      // Whatever reached the disk of it must not be found after a restart.
      lru_.Remove(slots[i]);
      s.state = SlotState::kFree;
      free_.push_back(slots[i]);
      erase_.insert(slots[i]);
      ++(invalidated ? disk_.invalidated : counters_.dropped_write_errors);
      continue;
    }
    s.entry = e;
    s.state = SlotState::kStored;
    index_.emplace(Key{e.ns.value(), e.hash}, slots[i]);
    lru_.Relink(slots[i]);
    ++counters_.written;
    counters_.bytes_written += static_cast<uint64_t>(slot_bytes_ + kIndexEntryBytes);
    changes->push_back({.entry = e, .stored = true});
  }
  if (!io.ok()) {
    ++disk_.write_errors;
    Logger("tier").warn("disk tier {}: a write failed, its blocks are dropped: {}",
                        options_.directory, io.ToString());
  }
}

absl::Status DiskBlockStore::ClearEntries(const std::vector<int32_t>& slots,
                                          size_t* cleared) const {
  static constexpr std::byte kZero[kIndexEntryBytes] = {};
  for (*cleared = 0; *cleared < slots.size(); ++*cleared) {
    if (options_.clear_entry_fault) KVPOOL_RETURN_IF_ERROR(options_.clear_entry_fault());
    const iovec part{const_cast<std::byte*>(kZero), static_cast<size_t>(kIndexEntryBytes)};
    KVPOOL_RETURN_IF_ERROR(files_.index.WriteAt(slots[*cleared] * kIndexEntryBytes, {&part, 1}));
  }
  return absl::OkStatus();
}

absl::Status DiskBlockStore::WriteRecords(const std::vector<QueuedWrite>& batch,
                                          const std::vector<int32_t>& slots) {
  const std::vector<std::vector<size_t>> runs = Runs(slots);
  for (const std::vector<size_t>& run : runs) {
    std::vector<iovec> parts;
    for (size_t i : run) parts.push_back({batch[i].bytes.data(), static_cast<size_t>(slot_bytes_)});
    const int64_t offset = int64_t{slots[run.front()]} * slot_bytes_;
    if (absl::Status s = files_.data.WriteAt(offset, parts); !s.ok()) return s;
  }
  const bool sync =
      options_.fsync == DiskFsync::kBatch || (options_.fsync == DiskFsync::kPeriodic && SyncDue());
  // The bytes before their entries: with a sync between, an entry on disk has its bytes there.
  if (sync) {
    if (absl::Status s = files_.data.Sync(); !s.ok()) return s;
  }
  for (const std::vector<size_t>& run : runs) {
    std::vector<std::byte> entries(run.size() * kIndexEntryBytes);
    for (size_t k = 0; k < run.size(); ++k) {
      EncodeIndexEntry(batch[run[k]].entry,
                       std::span(entries).subspan(k * kIndexEntryBytes, kIndexEntryBytes));
    }
    const iovec part{entries.data(), entries.size()};
    if (absl::Status s =
            files_.index.WriteAt(int64_t{slots[run.front()]} * kIndexEntryBytes, {&part, 1});
        !s.ok()) {
      return s;
    }
  }
  return sync ? files_.index.Sync() : absl::OkStatus();
}

bool DiskBlockStore::SyncDue() {
  const int64_t now = clock_->NowNanos();
  absl::MutexLock lock(&mu_);
  if (now - last_sync_ns_ < absl::ToInt64Nanoseconds(options_.fsync_interval)) return false;
  last_sync_ns_ = now;
  return true;
}

absl::Status DiskBlockStore::Flush(absl::Duration timeout) {
  const int64_t deadline_ns = clock_->NowNanos() + absl::ToInt64Nanoseconds(timeout);
  absl::MutexLock lock(&mu_);
  const int64_t target = enqueued_;
  // Queued writes, and the entries of dropped records (evicted, invalidated) still to clear.
  // While the breaker is open those wait for the disk to take writes again: not waited for.
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return completed_ >= target && erasing_ == 0 &&
           (erase_.empty() || breaker_.state() == BreakerState::kOpen);
  };
  if (!clock_->AwaitUntil(mu_, absl::Condition(&done), deadline_ns)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "disk tier: ", std::max<int64_t>(target - completed_, 0), " writes still queued, ",
        erase_.size() + static_cast<size_t>(erasing_), " entries to clear"));
  }
  if (!erase_.empty()) {
    return absl::UnavailableError(
        absl::StrCat("disk tier: the disk fails (breaker open): ", erase_.size(),
                     " entries of dropped records still to clear"));
  }
  return absl::OkStatus();
}

int64_t DiskBlockStore::Invalidate(const TagFilter& filter) {
  std::vector<Change> changes;
  int64_t dropped = 0;
  {
    absl::MutexLock lock(&mu_);
    for (int32_t slot = 0; slot < static_cast<int32_t>(slots_count_); ++slot) {
      const Slot& s = slots_[static_cast<size_t>(slot)];
      if (s.state == SlotState::kStored && filter.Matches(s.entry.tags)) {
        DropStored(slot, &changes);
        ++dropped;
      }
    }
    for (auto it = queue_.begin(); it != queue_.end();) {
      if (!filter.Matches(it->entry.tags)) {
        ++it;
        continue;
      }
      queued_bytes_ -= slot_bytes_;
      ++completed_;
      ++dropped;
      it = queue_.erase(it);
    }
    filters_in_batch_.push_back(filter);  // and what the writer is writing now
    disk_.invalidated += static_cast<uint64_t>(dropped);
    changed_.SignalAll();
  }
  Tell(changes);
  return dropped;
}

RemoteTierStats DiskBlockStore::stats() const {
  RemoteTierStats out;
  {
    absl::MutexLock lock(&mu_);
    out = counters_;
    out.queued_blocks = static_cast<int64_t>(queue_.size());
    out.queued_bytes = queued_bytes_;
  }
  out.breaker = breaker_.state();
  out.breaker_opens = breaker_.opens();
  return out;
}

DiskTierStats DiskBlockStore::disk_stats() const {
  absl::MutexLock lock(&mu_);
  DiskTierStats out = disk_;
  out.capacity_blocks = slots_count_;
  out.blocks = static_cast<int64_t>(index_.size());
  out.direct_io = files_.data.direct();
  return out;
}

}  // namespace kvpool::tier

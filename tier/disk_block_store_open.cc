// DiskBlockStore: opening a directory, and the index rebuilt from it (disk_block_store.h).

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "fmt/format.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"
#include "tier/disk_block_store.h"

namespace kvpool::tier {
namespace {

// Index entries read per call while rebuilding (1 MiB).
constexpr int64_t kScanChunkEntries = 8192;

absl::Status CheckOptions(const DiskTierOptions& o, int64_t block_bytes) {
  const auto bad = [](const std::string& field, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("disk tier: ", field, " ", why));
  };
  if (o.directory.empty() || o.directory[0] != '/') {
    return bad("directory", absl::StrCat("must be an absolute path (got '", o.directory, "')"));
  }
  if (block_bytes <= 0) return bad("block_bytes", "must be > 0");
  if (o.capacity_bytes < AlignUp(block_bytes)) {
    return bad("capacity_bytes",
               absl::StrCat(o.capacity_bytes, " holds no record of ", AlignUp(block_bytes),
                            " bytes (a block of ", block_bytes, " padded to 4096)"));
  }
  if (o.capacity_bytes / AlignUp(block_bytes) > std::numeric_limits<int32_t>::max()) {
    return bad("capacity_bytes", "gives more than 2^31 records");
  }
  if (o.write_queue_blocks <= 0) return bad("write_queue_blocks", "must be > 0");
  if (o.tenant_shares < 0) return bad("tenant_shares", "must be >= 0");
  if (o.write_queue_bytes < AlignUp(block_bytes)) {
    return bad("write_queue_bytes", "must hold one record at least");
  }
  if (o.write_batch_blocks <= 0 || o.write_batch_blocks > 1024) {
    return bad("write_batch_blocks", "must be in [1, 1024]");
  }
  if (o.fsync == DiskFsync::kPeriodic && o.fsync_interval <= absl::ZeroDuration()) {
    return bad("fsync_interval", "must be > 0");
  }
  if (o.breaker_failure_threshold < 1 || o.breaker_backoff <= absl::ZeroDuration() ||
      o.breaker_max_backoff < o.breaker_backoff) {
    return bad("breaker", "needs a threshold >= 1 and 0 < backoff <= max_backoff");
  }
  return absl::OkStatus();
}

// Why a directory whose superblock is `found` cannot be used as it is for `want`; "" when it can
// (a changed slot count keeps the records that still fit).
std::string Mismatch(const Superblock& found, const Superblock& want) {
  if (found.secret_fingerprint != want.secret_fingerprint) {
    return "it was written under another deployment secret";
  }
  if (found.layout_fingerprint != want.layout_fingerprint ||
      found.block_bytes != want.block_bytes || found.slot_bytes != want.slot_bytes) {
    return "it was written for another pool layout";
  }
  if (found.content_fingerprint != want.content_fingerprint) {
    return "it was written for another model";
  }
  return "";
}

}  // namespace

absl::StatusOr<std::unique_ptr<DiskBlockStore>> DiskBlockStore::Open(const DiskTierOptions& options,
                                                                     const DeploymentSecret& secret,
                                                                     uint64_t layout_fingerprint,
                                                                     int64_t block_bytes,
                                                                     const Clock* clock) {
  KVPOOL_RETURN_IF_ERROR(CheckOptions(options, block_bytes));
  KVPOOL_RETURN_IF_ERROR(internal::MakeDirectory(options.directory));
  Files files;
  KVPOOL_ASSIGN_OR_RETURN(files.meta,
                          internal::DiskFile::Open(options.directory + "/tier.meta", false));
  KVPOOL_ASSIGN_OR_RETURN(
      files.data, internal::DiskFile::Open(options.directory + "/blocks.kvd", options.direct_io));
  KVPOOL_ASSIGN_OR_RETURN(files.index,
                          internal::DiskFile::Open(options.directory + "/index.kvi", false));
  const int64_t slots = options.capacity_bytes / AlignUp(block_bytes);
  std::unique_ptr<DiskBlockStore> store(new DiskBlockStore(
      options, secret, layout_fingerprint, block_bytes, slots, std::move(files), clock));
  const int64_t started = clock->NowNanos();
  KVPOOL_RETURN_IF_ERROR(store->Prepare());
  int64_t recovered = 0;
  {
    absl::MutexLock lock(&store->mu_);
    store->disk_.scan_ns = clock->NowNanos() - started;
    store->disk_.recovered_blocks = recovered = static_cast<int64_t>(store->index_.size());
  }
  Logger("tier").info("disk tier {}: {} of {} records of {} bytes kept, rebuilt in {:.1f} ms{}",
                      options.directory, recovered, slots, store->slot_bytes_,
                      static_cast<double>(store->disk_stats().scan_ns) * 1e-6,
                      store->files_.data.direct() ? " (O_DIRECT)" : "");
  store->writer_ = std::thread([s = store.get()] { s->WriterLoop(); });
  return store;
}

Superblock DiskBlockStore::Wanted() const {
  return {.secret_fingerprint = secret_.fingerprint(),
          .layout_fingerprint = layout_fingerprint_,
          .content_fingerprint = options_.content_fingerprint,
          .block_bytes = block_bytes_,
          .slot_bytes = slot_bytes_,
          .slots = slots_count_};
}

absl::Status DiskBlockStore::Prepare() {
  const Superblock want = Wanted();
  KVPOOL_ASSIGN_OR_RETURN(internal::AlignedBuffer buffer,
                          internal::AlignedBuffer::Create(kSuperblockBytes));
  KVPOOL_ASSIGN_OR_RETURN(const int64_t meta_bytes, files_.meta.Size());
  KVPOOL_ASSIGN_OR_RETURN(const int64_t index_bytes, files_.index.Size());
  Superblock found;
  SuperblockCheck check = SuperblockCheck::kMissing;
  if (meta_bytes >= kSuperblockBytes) {
    const iovec part{buffer.data(), static_cast<size_t>(kSuperblockBytes)};
    KVPOOL_RETURN_IF_ERROR(files_.meta.ReadAt(0, {&part, 1}));
    check = DecodeSuperblock(buffer.span(), &found);
  }
  std::string why;
  switch (check) {
    case SuperblockCheck::kOk:
      why = Mismatch(found, want);
      if (why.empty()) return Rebuild(found.slots);
      break;
    case SuperblockCheck::kVersion:
      why = fmt::format(
          "it was written by an incompatible kvpoold (format version {}; this one "
          "reads version {})",
          found.version, kDiskFormatVersion);
      break;
    case SuperblockCheck::kMissing:
      if (index_bytes > 0 || meta_bytes > 0) why = "its superblock is missing or damaged";
      break;
  }
  if (!why.empty()) {
    Logger("tier").warn("disk tier {}: {}: starting empty", options_.directory, why);
    absl::MutexLock lock(&mu_);
    disk_.started_empty = why;
  }
  return Reset();
}

absl::Status DiskBlockStore::Reset() {
  // The index first: once it is empty nothing of the old records can be found, whatever
  // happens to the rest.
  KVPOOL_RETURN_IF_ERROR(files_.index.Resize(0));
  KVPOOL_RETURN_IF_ERROR(files_.index.Resize(slots_count_ * kIndexEntryBytes));
  KVPOOL_RETURN_IF_ERROR(files_.index.Sync());
  KVPOOL_RETURN_IF_ERROR(files_.data.Resize(0));
  KVPOOL_RETURN_IF_ERROR(files_.data.Resize(slots_count_ * slot_bytes_));
  KVPOOL_ASSIGN_OR_RETURN(internal::AlignedBuffer buffer,
                          internal::AlignedBuffer::Create(kSuperblockBytes));
  EncodeSuperblock(Wanted(), buffer.span());
  const iovec part{buffer.data(), static_cast<size_t>(kSuperblockBytes)};
  KVPOOL_RETURN_IF_ERROR(files_.meta.WriteAt(0, {&part, 1}));
  KVPOOL_RETURN_IF_ERROR(files_.meta.Sync());
  absl::MutexLock lock(&mu_);
  for (Slot& slot : slots_) slot = Slot{};
  index_.clear();
  erase_.clear();
  lru_.Clear();
  free_.clear();
  for (int64_t slot = slots_count_ - 1; slot >= 0; --slot) {
    free_.push_back(static_cast<int32_t>(slot));
  }
  return absl::OkStatus();
}

absl::Status DiskBlockStore::Rebuild(int64_t old_slots) {
  // A truncated file reads as zeros past its end (records there fail their MAC: misses); a
  // changed budget keeps the records whose slots still exist.
  KVPOOL_RETURN_IF_ERROR(files_.index.Resize(slots_count_ * kIndexEntryBytes));
  KVPOOL_RETURN_IF_ERROR(files_.data.Resize(slots_count_ * slot_bytes_));
  if (old_slots != slots_count_) {
    KVPOOL_ASSIGN_OR_RETURN(internal::AlignedBuffer buffer,
                            internal::AlignedBuffer::Create(kSuperblockBytes));
    EncodeSuperblock(Wanted(), buffer.span());
    const iovec part{buffer.data(), static_cast<size_t>(kSuperblockBytes)};
    KVPOOL_RETURN_IF_ERROR(files_.meta.WriteAt(0, {&part, 1}));
    KVPOOL_RETURN_IF_ERROR(files_.meta.Sync());
  }
  const int64_t kept = std::min(old_slots, slots_count_);
  KVPOOL_ASSIGN_OR_RETURN(internal::AlignedBuffer chunk,
                          internal::AlignedBuffer::Create(kScanChunkEntries * kIndexEntryBytes));
  for (int64_t base = 0; base < kept; base += kScanChunkEntries) {
    const int64_t n = std::min(kScanChunkEntries, kept - base);
    const iovec part{chunk.data(), static_cast<size_t>(n * kIndexEntryBytes)};
    if (absl::Status s = files_.index.ReadAt(base * kIndexEntryBytes, {&part, 1}); !s.ok()) {
      const std::string why = absl::StrCat("its index cannot be read (", s.message(), ")");
      Logger("tier").warn("disk tier {}: {}: starting empty", options_.directory, why);
      {
        absl::MutexLock lock(&mu_);
        disk_.started_empty = why;
      }
      return Reset();
    }
    absl::MutexLock lock(&mu_);
    for (int64_t i = 0; i < n; ++i) {
      AdoptEntry(static_cast<int32_t>(base + i),
                 chunk.span().subspan(static_cast<size_t>(i * kIndexEntryBytes), kIndexEntryBytes));
    }
  }
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<uint64_t, int32_t>> stored;  // (write sequence, slot)
  for (int32_t slot = 0; slot < static_cast<int32_t>(slots_count_); ++slot) {
    if (slots_[static_cast<size_t>(slot)].state == SlotState::kStored) {
      stored.emplace_back(slots_[static_cast<size_t>(slot)].entry.sequence, slot);
    }
  }
  std::sort(stored.begin(), stored.end());
  for (const auto& [sequence, slot] : stored) {  // the latest ends up first in its share
    lru_.Add(slot, lru_.ShareOf(slots_[static_cast<size_t>(slot)].entry.tags.tenant));
  }
  free_.clear();
  for (int64_t slot = slots_count_ - 1; slot >= 0; --slot) {
    if (slots_[static_cast<size_t>(slot)].state == SlotState::kFree) {
      free_.push_back(static_cast<int32_t>(slot));
    }
  }
  return absl::OkStatus();
}

void DiskBlockStore::AdoptEntry(int32_t slot, std::span<const std::byte> bytes) {
  IndexEntry e;
  const EntryCheck check = DecodeIndexEntry(bytes, &e);
  if (check == EntryCheck::kFree) return;
  if (check == EntryCheck::kDamaged || e.payload_bytes != block_bytes_) {
    ++disk_.scan_dropped;
    erase_.insert(slot);
    return;
  }
  const Key key{e.ns.value(), e.hash};
  if (auto it = index_.find(key); it != index_.end()) {
    // The same block twice (a crash between two writes of it): keep the later one.
    ++disk_.scan_dropped;
    Slot& other = slots_[static_cast<size_t>(it->second)];
    if (other.entry.sequence > e.sequence) {
      erase_.insert(slot);
      return;
    }
    erase_.insert(it->second);
    other = Slot{};
    index_.erase(it);
  }
  slots_[static_cast<size_t>(slot)] = Slot{.entry = e, .state = SlotState::kStored};
  index_.emplace(key, slot);
  next_sequence_ = std::max(next_sequence_, e.sequence + 1);
}

}  // namespace kvpool::tier

// DiskBlockStore: lookups, and the store's invariants (disk_block_store.h).

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"
#include "tier/disk_block_store.h"

namespace kvpool::tier {

std::vector<DiskBlockStore::Planned> DiskBlockStore::PlanLookup(const BlockSpace& space,
                                                                const BlockHash& parent,
                                                                std::span<const BlockHash> hashes) {
  std::vector<Planned> plan;
  absl::MutexLock lock(&mu_);
  ++counters_.lookups;
  const BlockHash* want_parent = &parent;
  for (const BlockHash& hash : hashes) {
    const auto it = index_.find(Key{space.ns.value(), hash});
    if (it == index_.end()) break;
    const Slot& s = slots_[static_cast<size_t>(it->second)];
    if (s.entry.parent != *want_parent) {
      ++counters_.corrupt;  // another chain under this hash
      break;
    }
    plan.push_back({.slot = it->second, .entry = s.entry});
    lru_.Touch(it->second);
    want_parent = &hash;
  }
  return plan;
}

LookupResult DiskBlockStore::LookupChecked(const BlockSpace& space, const BlockHash& parent,
                                           std::span<const BlockHash> hashes,
                                           std::span<const std::span<std::byte>> out) {
  LookupResult result;
  std::vector<Planned> plan;
  if (space.layout_fingerprint == layout_fingerprint_) plan = PlanLookup(space, parent, hashes);
  if (!plan.empty() && options_.lookup_gap_hook) options_.lookup_gap_hook();
  bool rejected = false;
  if (!plan.empty()) {
    rejected = !breaker_.Allow();
    if (!rejected) result.hits = ReadVerified(plan, out);
  }
  for (int64_t i = 0; i < result.hits; ++i) {
    result.coverage.push_back(plan[static_cast<size_t>(i)].entry.coverage);
  }
  absl::MutexLock lock(&mu_);
  if (space.layout_fingerprint != layout_fingerprint_) ++counters_.lookups;
  if (rejected) ++counters_.rejected_lookups;
  counters_.hits += static_cast<uint64_t>(result.hits);
  counters_.misses += hashes.size() - static_cast<size_t>(result.hits);
  counters_.bytes_read += static_cast<uint64_t>(result.hits * block_bytes_);
  return result;
}

void DiskBlockStore::ReadPiece(std::span<const Planned> plan,
                               std::span<const std::span<std::byte>> out, Piece* piece) const {
  piece->verified = piece->begin;
  // Straight into the caller's buffers when O_DIRECT can take them; else a bounce buffer.
  piece->direct = slot_bytes_ == block_bytes_;
  for (size_t i = piece->begin; i < piece->end && piece->direct; ++i) {
    piece->direct = reinterpret_cast<uintptr_t>(out[i].data()) % kDiskAlign == 0;
  }
  internal::AlignedBuffer bounce;
  if (!piece->direct) {
    absl::StatusOr<internal::AlignedBuffer> made = internal::AlignedBuffer::Create(
        static_cast<int64_t>(piece->end - piece->begin) * slot_bytes_);
    if (!made.ok()) {
      piece->io = made.status();
      return;
    }
    bounce = *std::move(made);
  }
  std::vector<iovec> parts;
  for (size_t i = piece->begin; i < piece->end; ++i) {
    std::byte* to =
        piece->direct ? out[i].data() : bounce.data() + (i - piece->begin) * slot_bytes_;
    parts.push_back({to, static_cast<size_t>(slot_bytes_)});
  }
  piece->io = files_.data.ReadAt(int64_t{plan[piece->begin].slot} * slot_bytes_, parts);
  for (size_t i = piece->begin; i < piece->end && piece->io.ok(); ++i) {
    const std::span<const std::byte> bytes{
        static_cast<const std::byte*>(parts[i - piece->begin].iov_base),
        static_cast<size_t>(block_bytes_)};
    if (!VerifyEntry(secret_, layout_fingerprint_, bytes, plan[i].entry)) return;
    if (!piece->direct) std::memcpy(out[i].data(), bytes.data(), bytes.size());
    piece->verified = i + 1;
  }
}

int64_t DiskBlockStore::ReadVerified(std::span<const Planned> plan,
                                     std::span<const std::span<std::byte>> out) {
  // Runs of adjacent slots, cut into pieces of at most kReadPieceBlocks: each one preadv and its
  // blocks' tags, the pieces on up to kReadThreads threads at once (the caller's included), so
  // the disk sees several requests in flight and the MACs are checked while others read.
  std::vector<Piece> pieces;
  for (size_t i = 0; i < plan.size(); ++i) {
    if (pieces.empty() || plan[i].slot != plan[i - 1].slot + 1 ||
        i - pieces.back().begin >= static_cast<size_t>(kReadPieceBlocks)) {
      pieces.push_back({.begin = i});
    }
    pieces.back().end = i + 1;
  }
  for (size_t wave = 0; wave < pieces.size(); wave += kReadThreads) {
    const size_t last = std::min(pieces.size(), wave + kReadThreads);
    std::vector<std::thread> helpers;
    for (size_t p = wave + 1; p < last; ++p) {
      helpers.emplace_back([this, plan, out, piece = &pieces[p]] { ReadPiece(plan, out, piece); });
    }
    ReadPiece(plan, out, &pieces[wave]);
    for (std::thread& t : helpers) t.join();
  }
  int64_t verified = 0;
  absl::Status io;
  for (const Piece& piece : pieces) {
    if (!piece.io.ok()) {
      io = piece.io;
      break;
    }
    verified = static_cast<int64_t>(piece.verified);
    if (piece.verified < piece.end) {
      DropIfUnchanged(plan[piece.verified]);  // failed its MAC: dropped, and the rest misses
      break;
    }
  }
  // Past the hits, the caller's buffers hold nothing that failed a check.
  for (size_t i = static_cast<size_t>(verified); i < plan.size(); ++i) {
    std::memset(out[i].data(), 0, out[i].size());
  }
  if (!io.ok()) {
    breaker_.OnFailure();
    Logger("tier").warn("disk tier {}: a read failed: {}", options_.directory, io.ToString());
    absl::MutexLock lock(&mu_);
    ++disk_.read_errors;
  } else {
    breaker_.OnSuccess();
  }
  return verified;
}

void DiskBlockStore::DropIfUnchanged(const Planned& planned) {
  std::vector<Change> changes;
  {
    absl::MutexLock lock(&mu_);
    const Slot& s = slots_[static_cast<size_t>(planned.slot)];
    // Freed or written again since it was planned (the read raced an invalidation, an eviction
    // or the writer): the tag was checked against bytes that were never the planned record's,
    // and the new record stands. A plain miss, no sign of damage or tampering.
    if (s.state != SlotState::kStored || s.entry.sequence != planned.entry.sequence) return;
    ++counters_.corrupt;
    ++counters_.forged;
    DropStored(planned.slot, &changes);
    changed_.Signal();
  }
  Logger("tier").warn("disk tier {}: slot {} failed its MAC (torn, overwritten or forged): dropped",
                      options_.directory, planned.slot);
  Tell(changes);
}

absl::Status DiskBlockStore::CheckInvariants() const {
  absl::MutexLock lock(&mu_);
  int64_t stored = 0, free = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    stored += s.state == SlotState::kStored;
    free += s.state == SlotState::kFree;
    if ((s.state != SlotState::kFree) != (lru_.share_of_slot(static_cast<int32_t>(i)) >= 0)) {
      return absl::InternalError(absl::StrCat("disk tier: slot ", i,
                                              " is in a tenant share iff "
                                              "stored or being written, and is not"));
    }
    if (s.state != SlotState::kStored) continue;
    auto it = index_.find(Key{s.entry.ns.value(), s.entry.hash});
    if (it == index_.end() || it->second != static_cast<int32_t>(i)) {
      return absl::InternalError(absl::StrCat("disk tier: slot ", i, " is not indexed"));
    }
  }
  KVPOOL_RETURN_IF_ERROR(lru_.CheckInvariants());
  if (stored != static_cast<int64_t>(index_.size())) {
    return absl::InternalError(
        absl::StrCat("disk tier: ", stored, " stored slots, ", index_.size(), " indexed"));
  }
  absl::flat_hash_set<int32_t> seen;
  for (int32_t slot : free_) {
    if (slots_[static_cast<size_t>(slot)].state != SlotState::kFree || !seen.insert(slot).second) {
      return absl::InternalError(absl::StrCat("disk tier: free list holds slot ", slot));
    }
  }
  // Slots being written are in neither list; while the writer is idle there are none.
  if (static_cast<int64_t>(free_.size()) != free) {
    return absl::InternalError(
        absl::StrCat("disk tier: ", free, " free slots, ", free_.size(), " in the free list"));
  }
  if (queued_bytes_ != static_cast<int64_t>(queue_.size()) * slot_bytes_ ||
      completed_ > enqueued_) {
    return absl::InternalError("disk tier: the write queue's accounting does not balance");
  }
  return absl::OkStatus();
}

}  // namespace kvpool::tier

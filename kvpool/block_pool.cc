#include "kvpool/block_pool.h"

#include <algorithm>

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/logging.h"
#include "kvpool/util/status_macros.h"

namespace kvpool {
namespace {

absl::Status NoSuchBlock(BlockId block, int32_t num_blocks) {
  return absl::NotFoundError(
      fmt::format("block {} does not exist (pool has {})", block.value(), num_blocks));
}

}  // namespace

std::string_view BlockStateName(BlockState state) {
  switch (state) {
    case BlockState::kFree:
      return "FREE";
    case BlockState::kActive:
      return "ACTIVE";
    case BlockState::kCached:
      return "CACHED";
    case BlockState::kRetiring:
      return "RETIRING";
  }
  return "?";
}

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(const BlockPoolOptions& options) {
  if (options.num_blocks <= 0) {
    return absl::InvalidArgumentError(
        fmt::format("num_blocks must be > 0 (got {})", options.num_blocks));
  }
  if (!BlockTrace::IsValidDepth(options.trace_depth)) {
    return absl::InvalidArgumentError(
        fmt::format("trace_depth must be 0 or a power of two (got {})", options.trace_depth));
  }
  if (!(options.residency_sample >= 0 && options.residency_sample <= 1)) {
    return absl::InvalidArgumentError(
        fmt::format("residency_sample must be in [0, 1] (got {})", options.residency_sample));
  }
  if (options.max_namespaces < 1 || options.max_namespaces > kMaxNamespaceSlots) {
    return absl::InvalidArgumentError(fmt::format("max_namespaces must be in [1, {}] (got {})",
                                                  kMaxNamespaceSlots, options.max_namespaces));
  }
  return std::unique_ptr<BlockPool>(new BlockPool(options));
}

BlockPool::BlockPool(const BlockPoolOptions& options)
    : num_blocks_(options.num_blocks),
      fences_(options.fences),
      meta_(static_cast<size_t>(num_blocks_)),
      pending_(static_cast<size_t>(num_blocks_) * kMaxTimelines, 0),
      max_namespaces_(options.max_namespaces),
      namespaces_{kNoNamespace},
      slots_books_(1),
      slot_epoch_(1, 0),
      active_by_tally_(1, 0),
      residency_on_(options.residency_sample > 0),
      trace_(num_blocks_, options.trace_depth),
      residency_(num_blocks_, options.residency_sample, options.residency_seed) {
  free_list_.reserve(num_blocks_);
  // Highest id at the bottom so that a fresh pool hands out 0, 1, 2, ...
  for (int32_t b = num_blocks_ - 1; b >= 0; --b) free_list_.push_back(BlockId(b));
}

absl::StatusOr<NamespaceSlot> BlockPool::RegisterNamespace(NamespaceId ns) {
  if (ns == kNoNamespace) return absl::InvalidArgumentError("namespace 0 is reserved");
  if (auto it = slots_.find(ns); it != slots_.end()) return NamespaceSlot(it->second);
  if (namespaces_left() <= 0) {
    return absl::ResourceExhaustedError(
        fmt::format("too many namespaces ({} registered)", slots_.size()));
  }
  uint16_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
    namespaces_[slot] = ns;
  } else {
    slot = static_cast<uint16_t>(namespaces_.size());
    namespaces_.push_back(ns);
    slots_books_.emplace_back();
    slot_epoch_.push_back(0);
  }
  slots_.emplace(ns, slot);
  // A fresh or recycled slot owns nothing yet: only its tally to set.
  if (!tally_of_.empty()) slots_books_[slot].tally = tally_of(ns);
  return NamespaceSlot(slot);
}

void BlockPool::SetTally(NamespaceId ns, uint32_t tally) {
  if (tally >= active_by_tally_.size()) active_by_tally_.resize(tally + size_t{1}, 0);
  if (tally == 0) {
    tally_of_.erase(ns);
  } else {
    tally_of_[ns] = tally;
  }
  auto it = slots_.find(ns);
  if (it == slots_.end()) return;
  SlotBooks& books = slots_books_[it->second];
  if (books.tally != 0) active_by_tally_[books.tally] -= books.active;
  if (tally != 0) active_by_tally_[tally] += books.active;
  books.tally = tally;
}

uint32_t BlockPool::tally_of(NamespaceId ns) const {
  auto it = tally_of_.find(ns);
  return it == tally_of_.end() ? 0 : it->second;
}

std::optional<NamespaceSlot> BlockPool::FindNamespace(NamespaceId ns) const {
  if (auto it = slots_.find(ns); it != slots_.end()) return NamespaceSlot(it->second);
  return std::nullopt;
}

int32_t BlockPool::namespaces_left() const {
  return max_namespaces_ - static_cast<int32_t>(slots_.size());
}

std::vector<NamespaceSlot> BlockPool::IdleNamespaces(std::span<const uint8_t> held) const {
  idle_sweeps_.fetch_add(1, std::memory_order_relaxed);
  std::vector<NamespaceSlot> idle;
  for (size_t slot = 1; slot < namespaces_.size(); ++slot) {
    const bool is_held = slot < held.size() && held[slot] != 0;
    const SlotBooks& books = slots_books_[slot];
    if (namespaces_[slot] != kNoNamespace && books.held == 0 && books.named_by == 0 && !is_held) {
      idle.push_back(NamespaceSlot(static_cast<uint16_t>(slot)));
    }
  }
  return idle;
}

void BlockPool::RecycleNamespaces(std::span<const NamespaceSlot> slots) {
  if (slots.empty()) return;
  std::vector<uint8_t> wrapped;  // by slot: its epoch came round to one its FREE blocks may hold
  for (NamespaceSlot slot : slots) {
    const uint16_t s = slot.value();
    SlotBooks& books = slots_books_[s];
    KVPOOL_CHECK(s != 0 && s < namespaces_.size() && namespaces_[s] != kNoNamespace &&
                 books.held == 0 && books.named_by == 0 && books.active == 0);
    books.tally = 0;  // the namespace keeps its tally (tally_of_), the slot none
    // The slot's blocks are all FREE; from now on their epoch is behind the slot's.
    if (++slot_epoch_[s] == 0) {
      wrapped.resize(namespaces_.size(), 0);
      wrapped[s] = 1;
    }
    slots_.erase(namespaces_[s]);
    namespaces_[s] = kNoNamespace;
  }
  if (!wrapped.empty()) {
    blocks_swept_ += static_cast<uint64_t>(num_blocks_);
    for (size_t i = 0; i < static_cast<size_t>(num_blocks_); ++i) {
      const uint16_t owner = meta_[i].owner.slot;
      if (owner >= wrapped.size() || !wrapped[owner]) continue;
      KVPOOL_CHECK(meta_[i].state == BlockState::kFree);
      meta_[i].owner = {.slot = kScrubOwner};
    }
  }
  for (NamespaceSlot slot : slots) free_slots_.push_back(slot.value());
  // Descending: RegisterNamespace pops the lowest free slot first.
  std::sort(free_slots_.begin(), free_slots_.end(), std::greater<>());
  namespaces_recycled_ += slots.size();
}

absl::Status BlockPool::AllocateError(int32_t n, NamespaceSlot slot) const {
  if (n < 0) return absl::InvalidArgumentError(fmt::format("cannot allocate {} blocks", n));
  if (slot.value() == 0 || slot.value() >= namespaces_.size()) {
    return absl::InvalidArgumentError(fmt::format("unknown namespace slot {}", slot.value()));
  }
  return ResourceExhausted(Resource::kPoolBlocks, n - num_free(), "allocate");
}

absl::Status BlockPool::RetainError(BlockId block) const {
  if (!Contains(block)) return NoSuchBlock(block, num_blocks_);
  const Meta& m = meta_[Index(block)];
  if (m.state != BlockState::kActive && m.state != BlockState::kCached) {
    return absl::FailedPreconditionError(
        fmt::format("retain of block {} in state {}", block.value(), BlockStateName(m.state)));
  }
  return absl::FailedPreconditionError(
      fmt::format("reference count of block {} would saturate", block.value()));
}

absl::Status BlockPool::ReleaseSlow(BlockId block, const TraceContext& ctx,
                                    const std::source_location& site) {
  if (!Contains(block)) return NoSuchBlock(block, num_blocks_);
  const size_t i = Index(block);
  if (meta_[i].state != BlockState::kActive) {
    return ReportOverRelease(block, ctx, site,
                             meta_[i].state == BlockState::kCached
                                 ? "only the prefix cache's reference is left"
                                 : "the block has no reference");
  }
  // A shared block lost one holder; with only the cache's reference left it becomes CACHED.
  const uint32_t refs = --meta_[i].refs;
  meta_[i].last_use = ctx.time_ns;
  if (refs == 1 && meta_[i].cache_held) {
    meta_[i].state = BlockState::kCached;
    ++num_cached_;
    AddActive(meta_[i].owner.slot, -1);
  }
  trace_.Record(block, BlockOp::kRelease, refs, meta_[i].generation, ctx, site);
  return absl::OkStatus();
}

absl::Status BlockPool::AddCacheRefError(BlockId block) const {
  if (!Contains(block)) return NoSuchBlock(block, num_blocks_);
  const size_t i = Index(block);
  if (meta_[i].state != BlockState::kActive || meta_[i].cache_held) {
    return absl::FailedPreconditionError(fmt::format(
        "cache reference on block {} in state {}{}", block.value(), BlockStateName(meta_[i].state),
        meta_[i].cache_held ? " (already cache-held)" : ""));
  }
  return absl::FailedPreconditionError(
      fmt::format("reference count of block {} would saturate", block.value()));
}

absl::Status BlockPool::DropCacheRefSlow(BlockId block, const TraceContext& ctx,
                                         const std::source_location& site) {
  if (!Contains(block)) return NoSuchBlock(block, num_blocks_);
  const size_t i = Index(block);
  if (!meta_[i].cache_held) {
    return absl::FailedPreconditionError(
        fmt::format("the prefix cache holds no reference on block {}", block.value()));
  }
  meta_[i].cache_held = 0;
  const uint32_t refs = --meta_[i].refs;
  if (refs == 0) {
    --num_cached_;
    if (residency_on_) residency_.OnEvict(block, meta_[i].generation, ctx.time_ns);
    FreeOrRetire(block, ctx, site);
  } else {
    trace_.Record(block, BlockOp::kCacheDrop, refs, meta_[i].generation, ctx, site);
  }
  return absl::OkStatus();
}

absl::Status BlockPool::MarkInFlight(BlockId block, Fence fence, const TraceContext& ctx,
                                     std::source_location site) {
  if (!Contains(block)) return NoSuchBlock(block, num_blocks_);
  if (fence.timeline >= kMaxTimelines) {
    return absl::InvalidArgumentError(
        fmt::format("fence timeline {} >= {}", fence.timeline, kMaxTimelines));
  }
  if (fences_ == nullptr) {
    return absl::FailedPreconditionError("the pool has no FenceObserver to track device work");
  }
  const size_t i = Index(block);
  if (meta_[i].state != BlockState::kActive && meta_[i].state != BlockState::kCached) {
    return absl::FailedPreconditionError(fmt::format(
        "device work on block {} in state {}", block.value(), BlockStateName(meta_[i].state)));
  }
  if (fence.value == 0) return absl::OkStatus();
  uint64_t& pending = pending_[i * kMaxTimelines + fence.timeline];
  pending = std::max(pending, fence.value);
  meta_[i].in_flight |= static_cast<uint8_t>(1u << fence.timeline);
  trace_.Record(block, BlockOp::kInFlight, meta_[i].refs, meta_[i].generation, ctx, site);
  return absl::OkStatus();
}

int32_t BlockPool::ReclaimRetired(const TraceContext& ctx, std::source_location site) {
  int32_t reclaimed = 0;
  size_t kept = 0;
  for (size_t k = 0; k < retiring_.size(); ++k) {
    const BlockId block = retiring_[k];
    if (!FencesPassed(Index(block))) {
      retiring_[kept++] = block;
      continue;
    }
    fence_wait_.Observe(static_cast<double>(ctx.time_ns - meta_[Index(block)].last_use) * 1e-9);
    PushFree(block);
    trace_.Record(block, BlockOp::kReclaim, 0, meta_[Index(block)].generation, ctx, site);
    ++reclaimed;
  }
  retiring_.resize(kept);
  return reclaimed;
}

bool BlockPool::PendingFencesPassed(size_t i) const {
  const uint8_t mask = meta_[i].in_flight;
  for (uint32_t t = 0; t < kMaxTimelines; ++t) {
    if ((mask >> t & 1u) && !fences_->HasPassed(Fence{t, pending_[i * kMaxTimelines + t]})) {
      return false;
    }
  }
  return true;
}

void BlockPool::FreeOrRetire(BlockId block, const TraceContext& ctx,
                             const std::source_location& site) {
  const size_t i = Index(block);
  meta_[i].last_use = ctx.time_ns;
  if (meta_[i].in_flight != 0 && !FencesPassed(i)) {
    Retire(block, ctx, site);
    return;
  }
  PushFree(block);
  trace_.Record(block, BlockOp::kFree, 0, meta_[i].generation, ctx, site);
}

void BlockPool::Retire(BlockId block, const TraceContext& ctx, const std::source_location& site) {
  const size_t i = Index(block);
  meta_[i].state = BlockState::kRetiring;
  retiring_.push_back(block);
  ++retired_;
  trace_.Record(block, BlockOp::kRetire, 0, meta_[i].generation, ctx, site);
}

void BlockPool::ClearFences(size_t i) {
  meta_[i].in_flight = 0;
  std::fill_n(pending_.begin() + static_cast<ptrdiff_t>(i * kMaxTimelines), kMaxTimelines, 0);
}

absl::Status BlockPool::ReportOverRelease(BlockId block, const TraceContext& ctx,
                                          const std::source_location& site, std::string_view why) {
  const size_t i = Index(block);
  ++over_releases_;
  trace_.Record(block, BlockOp::kOverRelease, meta_[i].refs, meta_[i].generation, ctx, site);
  Logger("core").error("over-release of block {} (state {}, refs {}): {}; its history:\n{}",
                       block.value(), BlockStateName(meta_[i].state), meta_[i].refs, why,
                       trace_.Format(block));
  return absl::FailedPreconditionError(fmt::format(
      "release of block {} in state {}: {}", block.value(), BlockStateName(meta_[i].state), why));
}

BlockPoolStats BlockPool::stats() const {
  BlockPoolStats s;
  s.num_blocks = num_blocks_;
  s.free = num_free();
  s.active = num_active();
  s.cached = num_cached_;
  s.retiring = num_retiring();
  s.allocated = allocated_;
  s.freed = freed_;
  s.retired = retired_;
  s.scrubs = scrubs_;
  s.over_releases = over_releases_;
  s.namespaces = static_cast<int32_t>(slots_.size());
  s.namespaces_recycled = namespaces_recycled_;
  s.fence_wait = fence_wait_;
  s.residency = residency_.stats();
  return s;
}

absl::Status BlockPool::CheckInvariants() const {
  int32_t count[4] = {0, 0, 0, 0};
  std::vector<int32_t> active_by_ns(slots_books_.size(), 0);
  std::vector<int32_t> held_by_ns(slots_books_.size(), 0);
  for (int32_t b = 0; b < num_blocks_; ++b) {
    const size_t i = static_cast<size_t>(b);
    const BlockState state = meta_[i].state;
    ++count[static_cast<int>(state)];
    // A block not FREE belongs to a registered namespace, at its slot's epoch. A FREE block may
    // remember no owner (0), kScrubOwner, or a slot at that slot's epoch or before it (recycled
    // since: then strictly before).
    const OwnerTag tag = meta_[i].owner;
    const uint16_t owner = tag.slot;
    const bool registered =
        owner != 0 && owner < namespaces_.size() && namespaces_[owner] != kNoNamespace;
    if (state != BlockState::kFree) {
      if (!registered || tag.epoch != slot_epoch_[owner]) {
        return InvariantViolation(
            "{} block {} has owner slot {} epoch {}, not a registered "
            "namespace's current one",
            BlockStateName(state), b, owner, tag.epoch);
      }
      ++held_by_ns[owner];
    } else if (owner != 0 && owner != kScrubOwner &&
               (owner >= namespaces_.size() ||
                (registered ? tag.epoch > slot_epoch_[owner] : tag.epoch >= slot_epoch_[owner]))) {
      return InvariantViolation("FREE block {} remembers slot {} at epoch {}; the slot is at {}{}",
                                b, owner, tag.epoch, slot_epoch_[owner],
                                registered ? "" : " and was recycled since");
    }
    switch (state) {
      case BlockState::kFree:
      case BlockState::kRetiring:
        if (meta_[i].refs != 0 || meta_[i].cache_held) {
          return InvariantViolation("block {} is {} with refs {}{}", b, BlockStateName(state),
                                    meta_[i].refs,
                                    meta_[i].cache_held ? " and a cache reference" : "");
        }
        if (state == BlockState::kFree && meta_[i].in_flight != 0) {
          return InvariantViolation("FREE block {} still has fences pending", b);
        }
        break;
      case BlockState::kActive:
        if (meta_[i].refs == 0 || (meta_[i].refs == 1 && meta_[i].cache_held)) {
          return InvariantViolation("ACTIVE block {} has refs {}{}", b, meta_[i].refs,
                                    meta_[i].cache_held ? " (all of them the cache's)" : "");
        }
        ++active_by_ns[owner];
        break;
      case BlockState::kCached:
        if (meta_[i].refs != 1 || !meta_[i].cache_held) {
          return InvariantViolation("CACHED block {} has refs {}{}", b, meta_[i].refs,
                                    meta_[i].cache_held ? "" : " and no cache reference");
        }
        break;
    }
  }
  if (count[0] + count[1] + count[2] + count[3] != num_blocks_)
    return InvariantViolation("states do not sum");
  if (count[static_cast<int>(BlockState::kCached)] != num_cached_) {
    return InvariantViolation("cached count {} but {} blocks are CACHED", num_cached_,
                              count[static_cast<int>(BlockState::kCached)]);
  }
  for (size_t slot = 0; slot < slots_books_.size(); ++slot) {
    if (active_by_ns[slot] != slots_books_[slot].active) {
      return InvariantViolation("slot {} owns {} ACTIVE blocks, its count says {}", slot,
                                active_by_ns[slot], slots_books_[slot].active);
    }
    if (held_by_ns[slot] != slots_books_[slot].held) {
      return InvariantViolation("slot {} owns {} blocks that are not FREE, its count says {}", slot,
                                held_by_ns[slot], slots_books_[slot].held);
    }
  }
  KVPOOL_RETURN_IF_ERROR(CheckNamespaces());
  KVPOOL_RETURN_IF_ERROR(CheckTallies());
  return CheckLists(count[static_cast<int>(BlockState::kFree)],
                    count[static_cast<int>(BlockState::kRetiring)]);
}

absl::Status BlockPool::CheckLists(int32_t free, int32_t retiring) const {
  // Each FREE block is on the free list exactly once and nothing else is; same for RETIRING.
  std::vector<uint8_t> seen(num_blocks_, 0);
  auto check_list = [&](const std::vector<BlockId>& list, BlockState want, int32_t blocks,
                        std::string_view name) -> absl::Status {
    if (static_cast<int32_t>(list.size()) != blocks) {
      return InvariantViolation("{} has {} entries but {} blocks are {}", name, list.size(), blocks,
                                BlockStateName(want));
    }
    for (BlockId block : list) {
      if (!Contains(block))
        return InvariantViolation("{} holds invalid block {}", name, block.value());
      if (seen[Index(block)]++) return InvariantViolation("block {} listed twice", block.value());
      if (meta_[Index(block)].state != want) {
        return InvariantViolation("{} holds block {} in state {}", name, block.value(),
                                  BlockStateName(meta_[Index(block)].state));
      }
    }
    return absl::OkStatus();
  };
  KVPOOL_RETURN_IF_ERROR(check_list(free_list_, BlockState::kFree, free, "free list"));
  return check_list(retiring_, BlockState::kRetiring, retiring, "retiring list");
}

absl::Status BlockPool::CheckNamespaces() const {
  if (namespaces_.empty() || namespaces_[0] != kNoNamespace ||
      slots_books_.size() != namespaces_.size()) {
    return InvariantViolation("the namespace table has lost its slot 0 or its counts");
  }
  if (static_cast<int32_t>(slots_.size()) > max_namespaces_) {
    return InvariantViolation("{} namespaces registered, at most {}", slots_.size(),
                              max_namespaces_);
  }
  for (const auto& [ns, slot] : slots_) {
    if (ns == kNoNamespace || slot == 0 || slot >= namespaces_.size() || namespaces_[slot] != ns) {
      return InvariantViolation("namespace {} maps to slot {}, which is not its", ns.value(), slot);
    }
  }
  std::vector<uint8_t> free(namespaces_.size(), 0);
  for (uint16_t slot : free_slots_) {
    if (slot == 0 || slot >= namespaces_.size() || namespaces_[slot] != kNoNamespace ||
        free[slot]++) {
      return InvariantViolation("free namespace slot {} is in use or listed twice", slot);
    }
    const SlotBooks& books = slots_books_[slot];
    if (books.active != 0 || books.held != 0 || books.named_by != 0) {
      return InvariantViolation("free namespace slot {} owns {} blocks or is named by {} records",
                                slot, books.held, books.named_by);
    }
  }
  if (slots_.size() + free_slots_.size() + 1 != namespaces_.size()) {
    return InvariantViolation("{} namespace slots but {} registered and {} free",
                              namespaces_.size() - 1, slots_.size(), free_slots_.size());
  }
  return absl::OkStatus();
}

absl::Status BlockPool::CheckTallies() const {
  // Every slot is filed under its namespace's tally (a free slot under none), and each tally's
  // count is what a recount of its slots gives.
  std::vector<int64_t> active_by_tally(active_by_tally_.size(), 0);
  for (size_t slot = 0; slot < slots_books_.size(); ++slot) {
    const SlotBooks& books = slots_books_[slot];
    const uint32_t want = namespaces_[slot] == kNoNamespace ? 0 : tally_of(namespaces_[slot]);
    if (books.tally != want || books.tally >= active_by_tally_.size()) {
      return InvariantViolation("slot {} (namespace {}) is filed under tally {}, not {}", slot,
                                namespaces_[slot].value(), books.tally, want);
    }
    if (books.tally != 0) active_by_tally[books.tally] += books.active;
  }
  for (const auto& [ns, tally] : tally_of_) {
    if (tally == 0 || tally >= active_by_tally_.size()) {
      return InvariantViolation("namespace {} is filed under tally {} of {}", ns.value(), tally,
                                active_by_tally_.size());
    }
  }
  for (size_t tally = 0; tally < active_by_tally_.size(); ++tally) {
    if (active_by_tally[tally] != active_by_tally_[tally]) {
      return InvariantViolation("tally {} counts {} ACTIVE blocks, its slots own {}", tally,
                                active_by_tally_[tally], active_by_tally[tally]);
    }
  }
  return absl::OkStatus();
}

std::string BlockPool::DebugString() const {
  std::string out;
  auto it = std::back_inserter(out);
  fmt::format_to(it, "blocks={} cached={} allocated={} freed={} retired={} scrubs={} over={}\n",
                 num_blocks_, num_cached_, allocated_, freed_, retired_, scrubs_, over_releases_);
  for (int32_t b = 0; b < num_blocks_; ++b) {
    const size_t i = static_cast<size_t>(b);
    fmt::format_to(
        it, "{}:{} refs={} gen={} owner={}@{} cache={} inflight={} pending={}\n", b,
        BlockStateName(meta_[i].state), meta_[i].refs, meta_[i].generation, meta_[i].owner.slot,
        meta_[i].owner.epoch, meta_[i].cache_held, meta_[i].in_flight,
        fmt::join(pending_.begin() + static_cast<ptrdiff_t>(i * kMaxTimelines),
                  pending_.begin() + static_cast<ptrdiff_t>((i + 1) * kMaxTimelines), ","));
  }
  auto ids = [](const std::vector<BlockId>& list) {
    std::vector<int32_t> raw;
    for (BlockId b : list) raw.push_back(b.value());
    return raw;
  };
  fmt::format_to(it, "free: {}\nretiring: {}\nnamespaces:", fmt::join(ids(free_list_), " "),
                 fmt::join(ids(retiring_), " "));
  for (size_t s = 0; s < namespaces_.size(); ++s) {
    fmt::format_to(it, " {}={}", namespaces_[s].value(), slots_books_[s].active);
  }
  fmt::format_to(it, "\nfree slots: {} recycled={}", fmt::join(free_slots_, " "),
                 namespaces_recycled_);
  out += "\ntrace:\n";
  for (const BlockTraceEntry& e : trace_.All()) fmt::format_to(it, "{}\n", FormatTraceEntry(e));
  return out;
}

}  // namespace kvpool

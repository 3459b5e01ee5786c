// KvCacheManager: retention pins (the sequence operations live in kv_cache_manager.cc).

#include <algorithm>
#include <utility>

#include "fmt/format.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/status_macros.h"

namespace kvpool {
namespace {

absl::Status CheckPriority(int priority) {
  if (priority < 0 || priority >= kNumPriorities) {
    return absl::InvalidArgumentError(
        fmt::format("pin priority {} outside [0, {})", priority, kNumPriorities));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status KvCacheManager::CheckTtl(int64_t ttl_ns) const {
  if (ttl_ns <= 0 || ttl_ns > max_pin_ttl_ns_) {
    return absl::InvalidArgumentError(
        fmt::format("pin ttl {} ns outside (0, {}] (max_pin_ttl_ns)", ttl_ns, max_pin_ttl_ns_));
  }
  return absl::OkStatus();
}

absl::StatusOr<PinId> KvCacheManager::PinPrefix(SessionId caller, NamespaceId ns,
                                                std::span<const int32_t> tokens, int64_t ttl_ns,
                                                int priority) {
  const TraceContext ctx = BeginCall(caller, SequenceId(0));
  if (caller == kNoSession) return absl::InvalidArgumentError("session 0 is reserved");
  if (ns == kNoNamespace) return absl::InvalidArgumentError("namespace 0 is reserved");
  if (tokens.empty()) return absl::InvalidArgumentError("a pin needs at least one token");
  KVPOOL_RETURN_IF_ERROR(CheckTtl(ttl_ns));
  KVPOOL_RETURN_IF_ERROR(CheckPriority(priority));
  if (!cache_) return absl::FailedPreconditionError("the prefix cache is off: nothing to pin");
  const PrefixMatch match = cache_->Match(ns, tokens);
  if (match.matched_tokens < static_cast<int64_t>(tokens.size())) {
    return absl::NotFoundError(fmt::format(
        "only {} of the {} tokens to pin are cached in namespace {} (commit them first)",
        match.matched_tokens, tokens.size(), ns.value()));
  }
  std::vector<BlockId> blocks = match.full;
  if (match.partial != kInvalidBlock) blocks.push_back(match.partial);
  return MakePin(caller, ns, SequenceId(0), std::move(blocks), static_cast<int64_t>(tokens.size()),
                 ttl_ns, priority, ctx.time_ns);
}

absl::StatusOr<PinId> KvCacheManager::PinSequence(SessionId caller, SequenceId sequence,
                                                  int64_t ttl_ns, int priority) {
  const TraceContext ctx = BeginCall(caller, sequence);
  KVPOOL_ASSIGN_OR_RETURN(Sequence * seq, Owned(caller, sequence));
  KVPOOL_RETURN_IF_ERROR(CheckTtl(ttl_ns));
  KVPOOL_RETURN_IF_ERROR(CheckPriority(priority));
  if (!cache_) return absl::FailedPreconditionError("the prefix cache is off: nothing to pin");
  std::vector<BlockId> blocks = seq->path.full;
  int64_t tokens = static_cast<int64_t>(blocks.size()) * block_size_;
  if (seq->path.partial != kInvalidBlock) {
    blocks.push_back(seq->path.partial);
    tokens += cache_->CoverageOf(seq->path.partial);
  }
  if (blocks.empty()) {
    return absl::FailedPreconditionError(
        fmt::format("sequence {} has published nothing to pin (Commit first)", sequence.value()));
  }
  return MakePin(caller, seq->ns, sequence, std::move(blocks), tokens, ttl_ns, priority,
                 ctx.time_ns);
}

absl::StatusOr<PinId> KvCacheManager::MakePin(SessionId caller, NamespaceId ns, SequenceId sequence,
                                              std::vector<BlockId> blocks, int64_t tokens,
                                              int64_t ttl_ns, int priority, int64_t now_ns) {
  if (static_cast<int64_t>(pins_.size()) >= max_pins_) {
    ++counters_.exhausted;
    return absl::ResourceExhaustedError(
        fmt::format("pin: {} pins exist (max_pins {})", pins_.size(), max_pins_));
  }
  // Blocks only this pin would hold count against the namespace's quota.
  const std::pair<NamespaceId, int64_t> by_ns[] = {{ns, cache_->PinCharge(blocks)}};
  KVPOOL_RETURN_IF_ERROR(CountExhausted(CheckCapacity(by_ns, caller, 0, "pin")));
  const int64_t pinned = cache_->pinned_blocks() + cache_->NewlyPinned(blocks);
  if (pinned > max_pinned_blocks_) {
    return CountExhausted(
        ResourceExhausted(Resource::kPinnedBlocks, pinned - max_pinned_blocks_,
                          fmt::format("pin of {} blocks ({} pinned, at most {})", blocks.size(),
                                      cache_->pinned_blocks(), max_pinned_blocks_)));
  }

  // Everything checked: from here on nothing can fail.
  cache_->Pin(blocks, priority);
  const PinId id(next_pin_id_++);
  Pin& pin = pins_[id];
  pin.info = PinInfo{.id = id,
                     .session = caller,
                     .ns = ns,
                     .sequence = sequence,
                     .priority = priority,
                     .tokens = tokens,
                     .blocks = static_cast<int64_t>(blocks.size()),
                     .created_ns = now_ns,
                     .expires_ns = now_ns + ttl_ns};
  pin.blocks = std::move(blocks);
  deadlines_.emplace(pin.info.expires_ns, id);
  HoldPin(pin.info);
  ++counters_.pins_made;
  return id;
}

absl::StatusOr<KvCacheManager::Pin*> KvCacheManager::OwnedPin(SessionId caller, PinId pin) {
  auto it = pins_.find(pin);
  if (it == pins_.end()) return absl::NotFoundError(fmt::format("no pin {}", pin.value()));
  if (it->second.info.session != caller) {
    return absl::PermissionDeniedError(
        fmt::format("pin {} belongs to another session", pin.value()));
  }
  return &it->second;
}

absl::Status KvCacheManager::RenewPin(SessionId caller, PinId pin, int64_t ttl_ns) {
  const TraceContext ctx = BeginCall(caller, SequenceId(0));
  KVPOOL_ASSIGN_OR_RETURN(Pin * p, OwnedPin(caller, pin));
  KVPOOL_RETURN_IF_ERROR(CheckTtl(ttl_ns));
  deadlines_.erase({p->info.expires_ns, pin});
  p->info.created_ns = ctx.time_ns;
  p->info.expires_ns = ctx.time_ns + ttl_ns;
  deadlines_.emplace(p->info.expires_ns, pin);
  return absl::OkStatus();
}

absl::Status KvCacheManager::Unpin(SessionId caller, PinId pin) {
  BeginCall(caller, SequenceId(0));
  KVPOOL_RETURN_IF_ERROR(OwnedPin(caller, pin).status());
  ReleasePin(pin);
  return absl::OkStatus();
}

void KvCacheManager::ReleasePin(PinId pin) {
  auto it = pins_.find(pin);
  KVPOOL_CHECK(it != pins_.end());
  cache_->Unpin(it->second.blocks);
  deadlines_.erase({it->second.info.expires_ns, pin});
  UnholdPin(it->second.info);
  pins_.erase(it);
}

int64_t KvCacheManager::ExpirePinsAt(int64_t now_ns) {
  int64_t expired = 0;
  while (!deadlines_.empty() && deadlines_.begin()->first <= now_ns) {
    ReleasePin(deadlines_.begin()->second);
    ++expired;
  }
  counters_.pins_expired += static_cast<uint64_t>(expired);
  return expired;
}

int64_t KvCacheManager::ExpirePins() {
  const int64_t now = clock_->NowNanos();
  if (cache_) cache_->SetTime(now);
  return ExpirePinsAt(now);
}

std::vector<PinInfo> KvCacheManager::ListPins(SessionId session) const {
  const int64_t now = clock_->NowNanos();
  std::vector<PinInfo> out;
  // A pin whose time is up is over; the next call releases it.
  if (session != kNoSession) {
    // The session's own, from its holdings: never a walk over every pin.
    if (const SessionHoldings* held = HoldingsOf(session)) {
      visited_.fetch_add(held->pins.size(), std::memory_order_relaxed);
      for (PinId id : held->pins) {
        const PinInfo& info = pins_.at(id).info;
        if (info.expires_ns > now) out.push_back(info);
      }
    }
  } else {
    visited_.fetch_add(pins_.size(), std::memory_order_relaxed);
    for (const auto& [id, pin] : pins_) {
      if (pin.info.expires_ns > now) out.push_back(pin.info);
    }
  }
  std::sort(out.begin(), out.end(), [](const PinInfo& a, const PinInfo& b) { return a.id < b.id; });
  return out;
}

const PinInfo* KvCacheManager::FindPin(PinId pin) const {
  auto it = pins_.find(pin);
  return it == pins_.end() ? nullptr : &it->second.info;
}

absl::Status KvCacheManager::CheckPins(absl::flat_hash_map<BlockId, uint32_t>* locks,
                                       absl::flat_hash_map<BlockId, uint32_t>* pinned) const {
  if (static_cast<int64_t>(pins_.size()) > max_pins_)
    return InvariantViolation("more pins than max_pins");
  if (deadlines_.size() != pins_.size()) {
    return InvariantViolation("{} pins but {} deadlines", pins_.size(), deadlines_.size());
  }
  for (const auto& [id, pin] : pins_) {
    if (pin.info.id != id)
      return InvariantViolation("pin {} is filed under another id", id.value());
    if (pin.blocks.empty() || static_cast<int64_t>(pin.blocks.size()) != pin.info.blocks) {
      return InvariantViolation("pin {} holds {} blocks, {} reported", id.value(),
                                pin.blocks.size(), pin.info.blocks);
    }
    if (!deadlines_.contains({pin.info.expires_ns, id})) {
      return InvariantViolation("pin {} has no deadline queued", id.value());
    }
    for (BlockId block : pin.blocks) {
      if (!cache_->holds(block) || cache_->ns_of(block) != pin.info.ns) {
        return InvariantViolation("pin {} holds block {} outside its namespace's tree", id.value(),
                                  block.value());
      }
      if (cache_->priority(block) < pin.info.priority) {
        return InvariantViolation("pin {} block {} is below the pin's class", id.value(),
                                  block.value());
      }
      ++(*locks)[block];
      ++(*pinned)[block];
    }
  }
  if (!pins_.empty() && cache_->pinned_blocks() > max_pinned_blocks_) {
    return InvariantViolation("{} blocks pinned, max_pinned_blocks is {}", cache_->pinned_blocks(),
                              max_pinned_blocks_);
  }
  return absl::OkStatus();
}

}  // namespace kvpool

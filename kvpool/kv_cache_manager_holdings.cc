// KvCacheManager: what each session holds (SessionHoldings), kept as its sequences and pins come
// and go, and checked against a recount.

#include <string_view>

#include "absl/container/flat_hash_map.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/status_macros.h"

namespace kvpool {

const SessionHoldings* KvCacheManager::HoldingsOf(SessionId session) const {
  auto it = sessions_.find(session);
  return it == sessions_.end() || it->second.held.empty() ? nullptr : &it->second.held;
}

SessionHoldings::InNamespace KvCacheManager::HeldIn(SessionId session, NamespaceId ns) const {
  const SessionHoldings* held = HoldingsOf(session);
  if (held == nullptr) return {};
  auto it = held->namespaces.find(ns);
  return it == held->namespaces.end() ? SessionHoldings::InNamespace{} : it->second;
}

namespace {

// Takes one `count` (a sequence or a pin) of what `held` holds in `ns`, which it holds there; the
// entry goes once it holds nothing there (one lookup: this runs for every sequence freed).
void TakeOne(SessionHoldings* held, NamespaceId ns, int64_t SessionHoldings::InNamespace::*count) {
  auto it = held->namespaces.find(ns);
  KVPOOL_CHECK(it != held->namespaces.end() && it->second.*count > 0);
  --(it->second.*count);
  if (it->second.sequences == 0 && it->second.pins == 0) held->namespaces.erase(it);
}

}  // namespace

void KvCacheManager::HoldSequence(SessionUsage& usage, const Sequence& seq) {
  SessionHoldings& held = usage.held;
  KVPOOL_CHECK(held.sequences.insert(seq.id).second);
  ++held.namespaces[seq.ns].sequences;
  pool_->AddNamedBy(seq.slot, 1);
  if (window_) window_->AddNamedBy(seq.window_slot, 1);
}

void KvCacheManager::UnholdSequence(SessionUsage& usage, const Sequence& seq) {
  KVPOOL_CHECK(usage.held.sequences.erase(seq.id) == 1);
  TakeOne(&usage.held, seq.ns, &SessionHoldings::InNamespace::sequences);
  pool_->AddNamedBy(seq.slot, -1);
  if (window_) window_->AddNamedBy(seq.window_slot, -1);
}

void KvCacheManager::HoldPin(const PinInfo& pin) {
  SessionHoldings& held = sessions_[pin.session].held;
  KVPOOL_CHECK(held.pins.insert(pin.id).second);
  ++held.namespaces[pin.ns].pins;
}

void KvCacheManager::UnholdPin(const PinInfo& pin) {
  auto it = sessions_.find(pin.session);
  KVPOOL_CHECK(it != sessions_.end() && it->second.held.pins.erase(pin.id) == 1);
  TakeOne(&it->second.held, pin.ns, &SessionHoldings::InNamespace::pins);
}

absl::Status KvCacheManager::CheckHoldings() const {
  absl::flat_hash_map<SessionId, SessionHoldings> want;
  for (const auto& [id, seq] : sequences_) {
    SessionHoldings& held = want[seq.session];
    held.sequences.insert(id);
    ++held.namespaces[seq.ns].sequences;
  }
  for (const auto& [id, pin] : pins_) {
    SessionHoldings& held = want[pin.info.session];
    held.pins.insert(id);
    ++held.namespaces[pin.info.ns].pins;
  }
  for (const auto& [session, usage] : sessions_) {
    const SessionHoldings& held = usage.held;
    if (!want.contains(session) && !(held == SessionHoldings{})) {
      return InvariantViolation(
          "session {} holds nothing, but the books list {} sequences, {} "
          "pins in {} namespaces",
          session.value(), held.sequences.size(), held.pins.size(), held.namespaces.size());
    }
  }
  for (const auto& [session, held] : want) {
    const SessionHoldings* booked = HoldingsOf(session);
    if (booked == nullptr || !(*booked == held)) {
      return InvariantViolation(
          "session {} holds {} sequences and {} pins in {} namespaces, the books say {}, {} in {}",
          session.value(), held.sequences.size(), held.pins.size(), held.namespaces.size(),
          booked ? booked->sequences.size() : 0, booked ? booked->pins.size() : 0,
          booked ? booked->namespaces.size() : 0);
    }
  }
  return absl::OkStatus();
}

absl::Status KvCacheManager::CheckNamedSlots() const {
  const auto check = [&](const BlockPool& pool, auto slot_of, std::string_view what) {
    std::vector<int32_t> named(static_cast<size_t>(pool.namespace_slots()), 0);
    for (const auto& [id, seq] : sequences_) {
      const NamespaceSlot slot = slot_of(seq);
      if (slot.value() == 0 || slot.value() >= named.size()) {
        return InvariantViolation("sequence {} names {} slot {}, not one of the table's",
                                  id.value(), what, slot.value());
      }
      ++named[slot.value()];
    }
    for (size_t s = 1; s < named.size(); ++s) {
      const int32_t booked = pool.named_by(NamespaceSlot(static_cast<uint16_t>(s)));
      if (named[s] != booked) {
        return InvariantViolation("{} slot {} is named by {} sequences, its count says {}", what, s,
                                  named[s], booked);
      }
    }
    return absl::OkStatus();
  };
  KVPOOL_RETURN_IF_ERROR(check(
      *pool_, [](const Sequence& seq) { return seq.slot; }, "namespace"));
  if (window_) {
    KVPOOL_RETURN_IF_ERROR(check(
        *window_, [](const Sequence& seq) { return seq.window_slot; }, "window"));
  }
  return absl::OkStatus();
}

}  // namespace kvpool

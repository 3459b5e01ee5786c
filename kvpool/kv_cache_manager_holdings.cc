// KvCacheManager: what each session holds (SessionHoldings), kept as its sequences and pins come
// and go, and checked against a recount.

#include "absl/container/flat_hash_map.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"

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
}

void KvCacheManager::UnholdSequence(SessionUsage& usage, const Sequence& seq) {
  KVPOOL_CHECK(usage.held.sequences.erase(seq.id) == 1);
  TakeOne(&usage.held, seq.ns, &SessionHoldings::InNamespace::sequences);
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

}  // namespace kvpool

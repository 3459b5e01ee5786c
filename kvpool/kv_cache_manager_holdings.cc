// KvCacheManager: what each session holds (SessionHoldings), kept as its sequences and pins come
// and go, and checked against a recount.

#include "absl/container/flat_hash_map.h"
#include "kvpool/kv_cache_manager.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"

namespace kvpool {

const SessionHoldings* KvCacheManager::HoldingsOf(SessionId session) const {
  auto it = holdings_.find(session);
  return it == holdings_.end() ? nullptr : &it->second;
}

SessionHoldings::InNamespace KvCacheManager::HeldIn(SessionId session, NamespaceId ns) const {
  const SessionHoldings* held = HoldingsOf(session);
  if (held == nullptr) return {};
  auto it = held->namespaces.find(ns);
  return it == held->namespaces.end() ? SessionHoldings::InNamespace{} : it->second;
}

namespace {

// Drops `ns` from `held` once it holds nothing there, and the session's entry once it holds
// nothing at all.
void DropEmptied(absl::flat_hash_map<SessionId, SessionHoldings>* holdings,
                 absl::flat_hash_map<SessionId, SessionHoldings>::iterator held, NamespaceId ns) {
  auto in = held->second.namespaces.find(ns);
  if (in->second.sequences == 0 && in->second.pins == 0) held->second.namespaces.erase(in);
  if (held->second.namespaces.empty()) {
    KVPOOL_CHECK(held->second.sequences.empty() && held->second.pins.empty());
    holdings->erase(held);
  }
}

}  // namespace

void KvCacheManager::HoldSequence(const Sequence& seq) {
  SessionHoldings& held = holdings_[seq.session];
  KVPOOL_CHECK(held.sequences.insert(seq.id).second);
  ++held.namespaces[seq.ns].sequences;
}

void KvCacheManager::UnholdSequence(const Sequence& seq) {
  auto held = holdings_.find(seq.session);
  KVPOOL_CHECK(held != holdings_.end() && held->second.sequences.erase(seq.id) == 1);
  auto in = held->second.namespaces.find(seq.ns);
  KVPOOL_CHECK(in != held->second.namespaces.end() && in->second.sequences > 0);
  --in->second.sequences;
  DropEmptied(&holdings_, held, seq.ns);
}

void KvCacheManager::HoldPin(const PinInfo& pin) {
  SessionHoldings& held = holdings_[pin.session];
  KVPOOL_CHECK(held.pins.insert(pin.id).second);
  ++held.namespaces[pin.ns].pins;
}

void KvCacheManager::UnholdPin(const PinInfo& pin) {
  auto held = holdings_.find(pin.session);
  KVPOOL_CHECK(held != holdings_.end() && held->second.pins.erase(pin.id) == 1);
  auto in = held->second.namespaces.find(pin.ns);
  KVPOOL_CHECK(in != held->second.namespaces.end() && in->second.pins > 0);
  --in->second.pins;
  DropEmptied(&holdings_, held, pin.ns);
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
  if (want.size() != holdings_.size()) {
    return InvariantViolation("{} sessions hold sequences or pins, the books list {}", want.size(),
                              holdings_.size());
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

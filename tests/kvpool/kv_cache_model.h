#pragma once

// The reference model of kv_cache_random_test: sequences as lists of abstract block handles
// with reference counts, plus pins holding handles of what sequences published. A handle is a
// block that is ACTIVE (a sequence holds it) or CACHED and pinned; a block the model forgot
// (refs 0) is FREE or CACHED and evictable, which for capacity is the same thing.

#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "kvpool/kv_cache_manager.h"

namespace kvpool::testing_model {

inline constexpr int32_t kBlockSize = 4;
inline constexpr int32_t kNumBlocks = 48;
inline constexpr int32_t kMaxBlocksPerSeq = 10;
inline constexpr SessionId kSessions[] = {SessionId(1), SessionId(2)};
inline constexpr NamespaceId kNamespaces[] = {NamespaceId(11), NamespaceId(22)};
inline constexpr int64_t kQuotaNs22 = 20;      // physical blocks
inline constexpr int64_t kQuotaSession2 = 30;  // block references
inline constexpr int32_t kMaxPins = 5;
inline constexpr int64_t kMaxPinnedBlocks = 12;
inline constexpr int64_t kMaxPinTtl = 4000;  // ns of the test's ManualClock

inline int64_t BlocksFor(int64_t tokens) {
  return tokens / kBlockSize + (tokens % kBlockSize ? 1 : 0);
}

struct Model {
  struct Seq {
    SessionId session;
    NamespaceId ns;
    int64_t tokens = 0;
    std::vector<int> handles;
    std::vector<uint32_t> content;  // the value written at each token position
    int64_t known = 0;              // tokens the manager knows (committed ones)
    int64_t published_full = 0;     // leading full blocks its tree path holds
  };
  struct Handle {
    int refs = 0;  // sequences holding it, plus pins
    NamespaceId ns;
    bool published = false;  // a tree node covers it whole: writes below it copy first
  };
  struct Pin {
    SessionId session;
    std::vector<int> handles;
    std::vector<BlockId> blocks;  // the real blocks, fixed while the pin lasts
    int64_t expires = 0;
  };
  std::map<SequenceId, Seq> seqs;
  std::map<int, Handle> handles;
  std::map<PinId, Pin> pins;
  int next_handle = 1;

  int64_t Used() const { return static_cast<int64_t>(handles.size()); }
  int64_t ActiveIn(NamespaceId ns) const {
    int64_t n = 0;
    for (const auto& [h, handle] : handles) n += handle.ns == ns;
    return n;
  }
  int64_t RefsOf(SessionId session) const {
    int64_t n = 0;
    for (const auto& [id, s] : seqs) {
      if (s.session == session) n += static_cast<int64_t>(s.handles.size());
    }
    return n;
  }
  int64_t PinnedHandles() const {
    std::set<int> all;
    for (const auto& [id, pin] : pins) all.insert(pin.handles.begin(), pin.handles.end());
    return static_cast<int64_t>(all.size());
  }
  bool Pinned(int h) const {
    for (const auto& [id, pin] : pins) {
      for (int x : pin.handles) {
        if (x == h) return true;
      }
    }
    return false;
  }
  // The code a call needing `blocks` new blocks in `ns` and `refs` new references must get.
  absl::StatusCode Capacity(NamespaceId ns, int64_t blocks, SessionId session, int64_t refs) const {
    if (blocks > 0 && ns == kNamespaces[1] && ActiveIn(ns) + blocks > kQuotaNs22) {
      return absl::StatusCode::kResourceExhausted;
    }
    if (refs > 0 && session == kSessions[1] && RefsOf(session) + refs > kQuotaSession2) {
      return absl::StatusCode::kResourceExhausted;
    }
    if (Used() + blocks > kNumBlocks) return absl::StatusCode::kResourceExhausted;
    return absl::StatusCode::kOk;
  }
  // Whether writing into the block a sequence ends inside must first copy it.
  bool MustCopy(int h, int taken) const {
    return handles.at(h).refs - taken > 1 || handles.at(h).published;
  }
  int NewHandle(NamespaceId ns) {
    handles[next_handle] = Handle{1, ns};
    return next_handle++;
  }
  void Drop(int h) {
    if (--handles[h].refs == 0) handles.erase(h);
  }
  void ReleasePin(PinId id) {
    for (int h : pins.at(id).handles) Drop(h);
    pins.erase(id);
  }
  // The code Owned() gives, or kOk.
  absl::StatusCode Ownership(SessionId caller, SequenceId id) const {
    auto it = seqs.find(id);
    if (it == seqs.end()) return absl::StatusCode::kNotFound;
    if (it->second.session != caller) return absl::StatusCode::kPermissionDenied;
    return absl::StatusCode::kOk;
  }
  // The code PinSequence must give, and the handles it would pin.
  absl::StatusCode PinOutcome(SessionId caller, SequenceId id, int64_t ttl, int priority,
                              std::vector<int>* handles) const {
    const absl::StatusCode owned = Ownership(caller, id);
    if (owned != absl::StatusCode::kOk) return owned;
    if (ttl <= 0 || ttl > kMaxPinTtl || priority < 0 || priority >= kNumPriorities) {
      return absl::StatusCode::kInvalidArgument;
    }
    const Model::Seq& m = seqs.at(id);
    handles->assign(m.handles.begin(), m.handles.begin() + m.published_full);
    if (handles->empty()) return absl::StatusCode::kFailedPrecondition;
    if (static_cast<int32_t>(pins.size()) >= kMaxPins) {
      return absl::StatusCode::kResourceExhausted;
    }
    int64_t newly = 0;
    for (int h : *handles) newly += Pinned(h) ? 0 : 1;
    if (PinnedHandles() + newly > kMaxPinnedBlocks) {
      return absl::StatusCode::kResourceExhausted;
    }
    return absl::StatusCode::kOk;
  }

  // What the manager does at the start of every call.
  void ExpirePins(int64_t now) {
    for (auto it = pins.begin(); it != pins.end();) {
      const PinId id = it->first;
      ++it;
      if (pins.at(id).expires <= now) ReleasePin(id);
    }
  }
};

}  // namespace kvpool::testing_model

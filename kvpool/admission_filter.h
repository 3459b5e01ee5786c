#pragma once

// AdmissionFilter: an EvictionPolicy in front of another that keeps a block past its request
// only if its content was seen before. Most blocks of a conversation trace are used once and
// never again (three in four on the Mooncake conversation trace); under LRU each of them pushes
// out a block that would have come back. The filter remembers the hashes of recently accessed
// blocks (a bounded ghost set: the last `history_blocks` accesses, whether or not the block
// stayed cached). A node inserted with a hash the ghost set holds, or hit by a new sequence, is
// admitted and ordered by the inner policy; any other node is on probation: it is evicted
// before every admitted node of its priority class, oldest first. Probation is not refusal:
// a probation block stays cached, and matchable, until space is needed.
//
// Pick it when most prompts carry blocks nobody asks for again (chat, agents, RAG); it costs a
// hash-map operation per access and ~32 bytes per remembered access. A partial node (no hash)
// is admitted only once it is hit. See docs/eviction.md.
//
// Ranks: probation nodes rank {priority, -1, release order}; admitted nodes rank as the inner
// policy says (whose scores must be >= 0). Add/Remove O(log n); OnInsert/OnHit O(1) amortized;
// Visit merges the probation order with the inner policy's.
//
// Thread-compatible.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/btree_set.h"
#include "kvpool/eviction_policy.h"
#include "kvpool/internal/fifo_history.h"

namespace kvpool {

class AdmissionFilter final : public EvictionPolicy {
 public:
  // REQUIRES: inner != nullptr, history_blocks > 0.
  AdmissionFilter(std::unique_ptr<EvictionPolicy> inner, int64_t history_blocks);

  void Reserve(NodeIndex capacity) override;
  void OnInsert(NodeIndex node, const NodeFacts& facts, int64_t now_ns) override;
  void OnHit(NodeIndex node, const NodeFacts& facts, int64_t now_ns) override;
  void OnErase(NodeIndex node, const NodeFacts& facts, int64_t now_ns) override;
  void Add(NodeIndex node, const NodeFacts& facts) override;
  void Remove(NodeIndex node, const NodeFacts& facts) override;
  bool Contains(NodeIndex node) const override;
  int64_t size() const override { return static_cast<int64_t>(probation_.size()) + inner_->size(); }
  EvictionRank Rank(NodeIndex node, const NodeFacts& facts, int64_t now_ns) const override;
  void Visit(int64_t now_ns,
             absl::FunctionRef<bool(NodeIndex, const EvictionRank&)> visit) const override;
  absl::Status CheckInvariants() const override;
  std::string DebugString() const override;

  // Whether `node` is admitted (ordered by the inner policy once it is a candidate).
  bool admitted(NodeIndex node) const { return admitted_[static_cast<size_t>(node)] != 0; }
  bool below_admission_bar(NodeIndex node) const override { return !admitted(node); }
  const EvictionPolicy& inner() const { return *inner_; }

 private:
  static constexpr int kOrderBits = 58;

  // Records an access to the block named `fingerprint`; returns whether it was seen before.
  bool Access(uint64_t fingerprint);

  std::unique_ptr<EvictionPolicy> inner_;
  internal::FifoHistory<uint8_t> seen_;                        // value unused: the ghost set
  std::vector<uint8_t> admitted_;                              // by node
  std::vector<uint8_t> on_probation_;                          // by node: a candidate in probation_
  absl::btree_set<std::pair<uint64_t, NodeIndex>> probation_;  // (priority, release order)
  uint64_t admitted_inserts_ = 0;  // inserts whose hash the ghost set held
  uint64_t probation_inserts_ = 0;
  NodeIndex added_below_ = 0;  // 1 + the highest node ever added (bounds CheckInvariants)
};

}  // namespace kvpool

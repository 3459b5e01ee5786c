#pragma once

// ReuseEvictionPolicy: evicts the leaf least likely to be used again soon, by a model learned
// online from the reuse gaps the cache observes (docs/eviction.md).
//
// ReuseModel estimates p(class, age) = P(a block is used again within `horizon` | it has been
// idle for `age`, its reuse class), where the class is how often its content was used before
// (never, once, twice, three times or more; remembered across evictions through a bounded
// history of evicted block hashes) and ages fall in half-octave buckets (< 1 s, then
// [2^(k/2), 2^((k+1)/2)) s up to 2048 s and beyond). It is a Kaplan-Meier estimate: every reuse
// records its gap, every block forgotten unreused (history overflow, a partial node evicted)
// records how long it was watched; histograms halve every `decay` of clock time so the model
// follows the workload. The estimate is made non-increasing in age, so within a class the
// oldest candidate is the least likely to come back, and the victim is the class head with the
// lowest estimate. With no data every estimate is 0 and the order is LRU.
//
// Pick it when reuse depends on how often a prefix was used (long conversations, popular
// system prompts) more than on when: it keeps blocks that came back repeatedly through idle
// gaps longer than the cache's turnover. Costs: Add/Remove O(log n) (a B-tree per priority and
// class); OnInsert/OnHit/OnErase O(1) amortized (one history operation); Visit compares the
// four class heads of the current priority per visited candidate; the model rebuilds its
// 4 x 24 table every 256 events. Memory: ~48 bytes per remembered evicted block.
//
// Thread-compatible.

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/btree_set.h"
#include "kvpool/eviction_policy.h"
#include "kvpool/internal/fifo_history.h"

namespace kvpool {

class ReuseModel final {
 public:
  static constexpr int kNumClasses = 4;      // reuse count 0, 1, 2, 3+
  static constexpr int kNumAgeBuckets = 24;  // < 1 s, then half-octaves; the last is open
  static constexpr int64_t kDecayNs = 600'000'000'000;  // histograms halve every 10 minutes
  static constexpr int kRebuildEvents = 256;

  // REQUIRES: horizon_ns > 0.
  explicit ReuseModel(int64_t horizon_ns);

  static int ClassOf(uint32_t reuse_count) {
    return reuse_count < kNumClasses ? static_cast<int>(reuse_count) : kNumClasses - 1;
  }
  static int BucketOf(int64_t age_ns);
  // The lower bound of an age bucket, in ns.
  static int64_t BucketStartNs(int bucket);

  // A block of class `cls` was used again `gap_ns` after its previous use.
  void RecordReuse(int cls, int64_t gap_ns, int64_t now_ns);
  // A block of class `cls` was watched for `age_ns` without being used again, then forgotten.
  void RecordCensored(int cls, int64_t age_ns, int64_t now_ns);
  // P(used again within the horizon | class, age), non-increasing in age, as of the last rebuild
  // (every kRebuildEvents recorded events). O(1).
  double Estimate(int cls, int64_t age_ns) const { return table_[cls][BucketOf(age_ns)]; }

  uint64_t reuses() const { return reuses_; }
  uint64_t censored() const { return censored_events_; }
  int64_t horizon_ns() const { return horizon_ns_; }
  std::string DebugString() const;

 private:
  using Row = std::array<double, kNumAgeBuckets>;
  void Record(Row& row, int64_t age_ns, int64_t now_ns);
  void Rebuild();

  const int64_t horizon_ns_;
  std::array<Row, kNumClasses> reuse_{};     // reuses by the bucket of their gap (decayed)
  std::array<Row, kNumClasses> censored_{};  // forgotten blocks by the bucket of their age
  std::array<Row, kNumClasses> table_{};     // the estimates
  int64_t last_decay_ns_ = 0;
  bool started_ = false;
  int since_rebuild_ = 0;
  uint64_t reuses_ = 0;
  uint64_t censored_events_ = 0;
};

class ReuseEvictionPolicy final : public EvictionPolicy {
 public:
  // REQUIRES: horizon_ns > 0, history_blocks > 0.
  ReuseEvictionPolicy(int64_t horizon_ns, int64_t history_blocks);

  void Reserve(NodeIndex capacity) override;
  void OnInsert(NodeIndex node, const NodeFacts& facts, int64_t now_ns) override;
  void OnHit(NodeIndex node, const NodeFacts& facts, int64_t now_ns) override;
  void OnErase(NodeIndex node, const NodeFacts& facts, int64_t now_ns) override;
  void Add(NodeIndex node, const NodeFacts& facts) override;
  void Remove(NodeIndex node, const NodeFacts& facts) override;
  bool Contains(NodeIndex node) const override {
    return node >= 0 && static_cast<size_t>(node) < set_of_.size() && set_of_[node] >= 0;
  }
  int64_t size() const override { return size_; }
  EvictionRank Rank(NodeIndex node, const NodeFacts& facts, int64_t now_ns) const override;
  void Visit(int64_t now_ns,
             absl::FunctionRef<bool(NodeIndex, const EvictionRank&)> visit) const override;
  absl::Status CheckInvariants() const override;
  std::string DebugString() const override;

  const ReuseModel& model() const { return model_; }
  ReuseModel* mutable_model() { return &model_; }  // tests teach it directly
  // How often the content of `node` was used before its latest use (its class's count).
  uint32_t reuse_count(NodeIndex node) const { return count_[static_cast<size_t>(node)]; }

 private:
  struct Past {
    int64_t last_ns = 0;
    uint32_t count = 0;
  };
  using Set = absl::btree_set<std::pair<uint64_t, NodeIndex>>;  // (release order, node)
  static constexpr int kNumSets = kNumPriorities * ReuseModel::kNumClasses;

  double Score(NodeIndex node, int64_t now_ns) const {
    return model_.Estimate(ReuseModel::ClassOf(count_[node]), now_ns - last_ns_[node]);
  }

  ReuseModel model_;
  internal::FifoHistory<Past> history_;  // evicted full blocks, by fingerprint
  std::array<Set, kNumSets> sets_;       // candidates by (priority, class)
  std::vector<uint32_t> count_;          // by node: earlier uses of its content
  std::vector<int64_t> last_ns_;         // by node: its last use or release
  std::vector<int8_t> set_of_;           // by node: which set holds it, -1: none
  int64_t size_ = 0;
  NodeIndex added_below_ = 0;  // 1 + the highest node ever added (bounds CheckInvariants)
};

}  // namespace kvpool

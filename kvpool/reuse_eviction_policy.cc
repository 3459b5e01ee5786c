#include "kvpool/reuse_eviction_policy.h"

#include <algorithm>
#include <cmath>

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"

namespace kvpool {
namespace {

constexpr int64_t kSecond = 1'000'000'000;

// Bucket starts: 0, then 2^(k/2) s for k = 0, 1, ...
constexpr std::array<int64_t, ReuseModel::kNumAgeBuckets> kStarts = [] {
  std::array<int64_t, ReuseModel::kNumAgeBuckets> s{};
  // 2^(k/2) * 1e9 without constexpr pow: even k are exact powers of two, odd ones times sqrt(2).
  for (int b = 1; b < ReuseModel::kNumAgeBuckets; ++b) {
    const int k = b - 1;
    const int64_t whole = kSecond << (k / 2);
    s[b] = k % 2 == 0 ? whole : whole / 1000 * 1'414'214 / 1000;
  }
  return s;
}();

// A bucket's nominal width (the last, open bucket counts as wide as its start).
int64_t Width(int b) {
  return b + 1 < ReuseModel::kNumAgeBuckets ? kStarts[b + 1] - kStarts[b] : kStarts[b];
}

}  // namespace

ReuseModel::ReuseModel(int64_t horizon_ns) : horizon_ns_(horizon_ns) {
  KVPOOL_CHECK(horizon_ns > 0);
}

int ReuseModel::BucketOf(int64_t age_ns) {
  const auto it = std::upper_bound(kStarts.begin() + 1, kStarts.end(), age_ns);
  return static_cast<int>(it - kStarts.begin()) - 1;
}

int64_t ReuseModel::BucketStartNs(int bucket) { return kStarts[bucket]; }

void ReuseModel::Record(Row& row, int64_t age_ns, int64_t now_ns) {
  if (!started_) {
    started_ = true;
    last_decay_ns_ = now_ns;
  }
  while (now_ns - last_decay_ns_ >= kDecayNs) {
    for (auto* rows : {&reuse_, &censored_}) {
      for (Row& r : *rows) {
        for (double& v : r) v *= 0.5;
      }
    }
    last_decay_ns_ += kDecayNs;
  }
  row[BucketOf(std::max<int64_t>(age_ns, 0))] += 1;
  if (++since_rebuild_ >= kRebuildEvents) Rebuild();
}

void ReuseModel::RecordReuse(int cls, int64_t gap_ns, int64_t now_ns) {
  ++reuses_;
  Record(reuse_[cls], gap_ns, now_ns);
}

void ReuseModel::RecordCensored(int cls, int64_t age_ns, int64_t now_ns) {
  ++censored_events_;
  Record(censored_[cls], age_ns, now_ns);
}

void ReuseModel::Rebuild() {
  since_rebuild_ = 0;
  constexpr int B = kNumAgeBuckets;
  for (int c = 0; c < kNumClasses; ++c) {
    // Kaplan-Meier: hazard per bucket from reuses over blocks still watched at its start.
    std::array<double, B + 1> at_risk{};
    for (int b = B - 1; b >= 0; --b) at_risk[b] = at_risk[b + 1] + reuse_[c][b] + censored_[c][b];
    std::array<double, B> hazard{};
    std::array<double, B + 1> survival{};
    survival[0] = 1;
    for (int b = 0; b < B; ++b) {
      hazard[b] = at_risk[b] > 0 ? reuse_[c][b] / at_risk[b] : 0;
      survival[b + 1] = survival[b] * (1 - hazard[b]);
    }
    // Survival at age t, geometric within a bucket.
    auto survival_at = [&](int64_t t) {
      const int b = BucketOf(t);
      const double fraction =
          std::min(1.0, static_cast<double>(t - kStarts[b]) / static_cast<double>(Width(b)));
      return survival[b] * std::pow(1 - hazard[b], fraction);
    };
    double running_min = 1;
    for (int b = 0; b < B; ++b) {
      double p = 0;
      if (at_risk[b] > 0 && survival[b] > 0) {
        p = 1 - survival_at(kStarts[b] + horizon_ns_) / survival[b];
      }
      running_min = std::min(running_min, p);
      table_[c][b] = running_min;
    }
  }
}

std::string ReuseModel::DebugString() const {
  std::string out = fmt::format("reuse model horizon={}s reuses={} censored={}",
                                horizon_ns_ / kSecond, reuses_, censored_events_);
  for (int c = 0; c < kNumClasses; ++c) {
    out += fmt::format(" c{}[0s]={:.3f}[16s]={:.3f}[128s]={:.3f}", c, table_[c][0],
                       table_[c][BucketOf(16 * kSecond)], table_[c][BucketOf(128 * kSecond)]);
  }
  return out;
}

ReuseEvictionPolicy::ReuseEvictionPolicy(int64_t horizon_ns, int64_t history_blocks)
    : model_(horizon_ns), history_(static_cast<size_t>(history_blocks)) {
  KVPOOL_CHECK(history_blocks > 0);
}

void ReuseEvictionPolicy::Reserve(NodeIndex capacity) {
  const size_t n = static_cast<size_t>(capacity);
  if (set_of_.size() >= n) return;
  count_.resize(n, 0);
  last_ns_.resize(n, 0);
  set_of_.resize(n, -1);
}

void ReuseEvictionPolicy::OnInsert(NodeIndex node, const NodeFacts& facts, int64_t now_ns) {
  // A node that became full keeps the count it gathered while partial (an erased node's is 0);
  // a block evicted before continues its history.
  uint32_t count = count_[node];
  if (const uint64_t fp = facts.fingerprint; fp != 0) {
    if (const Past* past = history_.Find(fp)) {
      model_.RecordReuse(ReuseModel::ClassOf(past->count), now_ns - past->last_ns, now_ns);
      count = std::max(count, past->count + 1);
      history_.Erase(fp);
    }
  }
  count_[node] = count;
  last_ns_[node] = now_ns;
}

void ReuseEvictionPolicy::OnHit(NodeIndex node, const NodeFacts&, int64_t now_ns) {
  model_.RecordReuse(ReuseModel::ClassOf(count_[node]), now_ns - last_ns_[node], now_ns);
  ++count_[node];
  last_ns_[node] = now_ns;
}

void ReuseEvictionPolicy::OnErase(NodeIndex node, const NodeFacts& facts, int64_t now_ns) {
  KVPOOL_DCHECK(!Contains(node));
  const int cls = ReuseModel::ClassOf(count_[node]);
  if (const uint64_t fp = facts.fingerprint; fp != 0) {
    const auto forgotten = history_.Put(fp, Past{last_ns_[node], count_[node]});
    if (forgotten) {
      model_.RecordCensored(ReuseModel::ClassOf(forgotten->second.count),
                            now_ns - forgotten->second.last_ns, now_ns);
    }
  } else {
    model_.RecordCensored(cls, now_ns - last_ns_[node], now_ns);  // a partial node: no history
  }
  count_[node] = 0;
  last_ns_[node] = 0;
}

void ReuseEvictionPolicy::Add(NodeIndex node, const NodeFacts& facts) {
  KVPOOL_DCHECK(!Contains(node) && facts.priority >= 0 && facts.priority < kNumPriorities);
  last_ns_[node] = std::max(last_ns_[node], facts.released_ns);
  const int set = facts.priority * ReuseModel::kNumClasses + ReuseModel::ClassOf(count_[node]);
  set_of_[node] = static_cast<int8_t>(set);
  sets_[set].emplace(facts.release_seq, node);
  added_below_ = std::max(added_below_, node + 1);
  ++size_;
}

void ReuseEvictionPolicy::Remove(NodeIndex node, const NodeFacts& facts) {
  KVPOOL_DCHECK(Contains(node));
  sets_[set_of_[node]].erase({facts.release_seq, node});
  set_of_[node] = -1;
  --size_;
}

EvictionRank ReuseEvictionPolicy::Rank(NodeIndex node, const NodeFacts& facts,
                                       int64_t now_ns) const {
  const int64_t since = std::max(last_ns_[node], facts.released_ns);
  return EvictionRank{.priority = facts.priority,
                      .score = model_.Estimate(ReuseModel::ClassOf(count_[node]), now_ns - since),
                      .order = facts.release_seq};
}

void ReuseEvictionPolicy::Visit(
    int64_t now_ns, absl::FunctionRef<bool(NodeIndex, const EvictionRank&)> visit) const {
  constexpr int C = ReuseModel::kNumClasses;
  for (int priority = 0; priority < kNumPriorities; ++priority) {
    // Merge the class orders: each is oldest first, so (the estimate being non-increasing in
    // age) its head is its lowest-ranked candidate.
    std::array<Set::const_iterator, C> next;
    for (int c = 0; c < C; ++c) next[c] = sets_[priority * C + c].begin();
    while (true) {
      int best = -1;
      EvictionRank best_rank;
      for (int c = 0; c < C; ++c) {
        if (next[c] == sets_[priority * C + c].end()) continue;
        const auto [order, node] = *next[c];
        const EvictionRank rank{.priority = priority, .score = Score(node, now_ns), .order = order};
        if (best < 0 || rank < best_rank) {
          best = c;
          best_rank = rank;
        }
      }
      if (best < 0) break;
      const NodeIndex node = next[best]->second;
      ++next[best];
      if (!visit(node, best_rank)) return;
    }
  }
}

absl::Status ReuseEvictionPolicy::CheckInvariants() const {
  int64_t filed = 0;
  for (NodeIndex node = 0; node < added_below_; ++node) filed += set_of_[node] >= 0 ? 1 : 0;
  int64_t in_sets = 0;
  for (int set = 0; set < kNumSets; ++set) {
    for (const auto& [order, node] : sets_[set]) {
      ++in_sets;
      if (set_of_[node] != set) return InvariantViolation("reuse: node {} is in set {}", node, set);
      if (set % ReuseModel::kNumClasses != ReuseModel::ClassOf(count_[node])) {
        return InvariantViolation("reuse: node {} is filed under another class", node);
      }
    }
  }
  if (filed != size_ || in_sets != size_) {
    return InvariantViolation("reuse: {} nodes filed, {} in sets, size {}", filed, in_sets, size_);
  }
  return absl::OkStatus();
}

std::string ReuseEvictionPolicy::DebugString() const {
  return fmt::format("reuse candidates={} history={}/{} {}", size_, history_.size(),
                     history_.capacity(), model_.DebugString());
}

}  // namespace kvpool

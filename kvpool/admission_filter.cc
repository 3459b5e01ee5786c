#include "kvpool/admission_filter.h"

#include <algorithm>
#include <utility>

#include "fmt/format.h"
#include "kvpool/util/check.h"
#include "kvpool/util/errors.h"

namespace kvpool {
namespace {

constexpr uint64_t kOrderMask = (uint64_t{1} << 58) - 1;

}  // namespace

AdmissionFilter::AdmissionFilter(std::unique_ptr<EvictionPolicy> inner, int64_t history_blocks)
    : inner_(std::move(inner)), seen_(static_cast<size_t>(history_blocks)) {
  KVPOOL_CHECK(inner_ != nullptr && history_blocks > 0);
}

void AdmissionFilter::Reserve(NodeIndex capacity) {
  inner_->Reserve(capacity);
  const size_t n = static_cast<size_t>(capacity);
  if (admitted_.size() >= n) return;
  admitted_.resize(n, 0);
  on_probation_.resize(n, 0);
}

bool AdmissionFilter::Access(uint64_t fingerprint) {
  if (fingerprint == 0) return false;
  return seen_.Touch(fingerprint, 0);
}

void AdmissionFilter::OnInsert(NodeIndex node, const NodeFacts& facts, int64_t now_ns) {
  // A partial node that became full keeps an earlier admission (it was hit).
  const bool seen = Access(facts.fingerprint);
  if (seen) {
    admitted_[node] = 1;
    ++admitted_inserts_;
  } else if (admitted_[node] == 0) {
    ++probation_inserts_;
  }
  inner_->OnInsert(node, facts, now_ns);
}

void AdmissionFilter::OnHit(NodeIndex node, const NodeFacts& facts, int64_t now_ns) {
  Access(facts.fingerprint);
  admitted_[node] = 1;
  inner_->OnHit(node, facts, now_ns);
}

void AdmissionFilter::OnErase(NodeIndex node, const NodeFacts& facts, int64_t now_ns) {
  KVPOOL_DCHECK(!Contains(node));
  admitted_[node] = 0;
  inner_->OnErase(node, facts, now_ns);
}

void AdmissionFilter::Add(NodeIndex node, const NodeFacts& facts) {
  if (admitted_[node] != 0) {
    inner_->Add(node, facts);
    return;
  }
  const uint64_t key = (static_cast<uint64_t>(facts.priority) << kOrderBits) | facts.release_seq;
  on_probation_[node] = 1;
  probation_.emplace(key, node);
  added_below_ = std::max(added_below_, node + 1);
}

void AdmissionFilter::Remove(NodeIndex node, const NodeFacts& facts) {
  if (on_probation_[node] == 0) {
    inner_->Remove(node, facts);
    return;
  }
  probation_.erase(
      {(static_cast<uint64_t>(facts.priority) << kOrderBits) | facts.release_seq, node});
  on_probation_[node] = 0;
}

bool AdmissionFilter::Contains(NodeIndex node) const {
  if (node < 0 || static_cast<size_t>(node) >= on_probation_.size()) return false;
  return on_probation_[node] != 0 || inner_->Contains(node);
}

EvictionRank AdmissionFilter::Rank(NodeIndex node, const NodeFacts& facts, int64_t now_ns) const {
  if (admitted_[node] != 0) return inner_->Rank(node, facts, now_ns);
  return EvictionRank{.priority = facts.priority, .score = -1, .order = facts.release_seq};
}

void AdmissionFilter::Visit(int64_t now_ns,
                            absl::FunctionRef<bool(NodeIndex, const EvictionRank&)> visit) const {
  auto next = probation_.begin();
  auto rank_of = [](uint64_t key) {
    return EvictionRank{
        .priority = static_cast<int>(key >> kOrderBits), .score = -1, .order = key & kOrderMask};
  };
  bool stopped = false;
  inner_->Visit(now_ns, [&](NodeIndex node, const EvictionRank& rank) {
    for (; next != probation_.end() && rank_of(next->first) < rank; ++next) {
      if (!visit(next->second, rank_of(next->first))) {
        stopped = true;
        return false;
      }
    }
    stopped = !visit(node, rank);
    return !stopped;
  });
  for (; !stopped && next != probation_.end(); ++next) {
    stopped = !visit(next->second, rank_of(next->first));
  }
}

absl::Status AdmissionFilter::CheckInvariants() const {
  size_t flagged = 0;
  for (NodeIndex node = 0; node < added_below_; ++node) flagged += on_probation_[node];
  if (flagged != probation_.size()) {
    return InvariantViolation("admission: {} nodes flagged, {} on probation", flagged,
                              probation_.size());
  }
  for (const auto& [key, node] : probation_) {
    if (on_probation_[node] == 0 || admitted_[node] != 0 || inner_->Contains(node)) {
      return InvariantViolation("admission: node {} is on probation and admitted", node);
    }
  }
  if (seen_.size() > seen_.capacity()) {
    return InvariantViolation("admission: the ghost set outgrew its capacity");
  }
  return inner_->CheckInvariants();
}

std::string AdmissionFilter::DebugString() const {
  return fmt::format("admit(probation={} ghost={}/{} admitted_inserts={} probation_inserts={}) {}",
                     probation_.size(), seen_.size(), seen_.capacity(), admitted_inserts_,
                     probation_inserts_, inner_->DebugString());
}

}  // namespace kvpool

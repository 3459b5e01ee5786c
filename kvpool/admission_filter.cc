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
  probation_key_.resize(n, kAbsent);
}

bool AdmissionFilter::Access(uint64_t fingerprint) {
  if (fingerprint == 0) return false;
  const bool seen = seen_.Find(fingerprint) != nullptr;
  seen_.Put(fingerprint, 0);
  return seen;
}

void AdmissionFilter::OnInsert(NodeIndex node, const NodeFacts& facts, int64_t now_ns) {
  // A partial node that became full keeps an earlier admission (it was hit).
  const bool seen = Access(BlockFingerprint(facts.hash));
  if (seen) {
    admitted_[node] = 1;
    ++admitted_inserts_;
  } else if (admitted_[node] == 0) {
    ++probation_inserts_;
  }
  inner_->OnInsert(node, facts, now_ns);
}

void AdmissionFilter::OnHit(NodeIndex node, const NodeFacts& facts, int64_t now_ns) {
  Access(BlockFingerprint(facts.hash));
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
  probation_key_[node] = key;
  probation_.emplace(key, node);
  added_below_ = std::max(added_below_, node + 1);
}

void AdmissionFilter::Remove(NodeIndex node) {
  if (probation_key_[node] == kAbsent) {
    inner_->Remove(node);
    return;
  }
  probation_.erase({probation_key_[node], node});
  probation_key_[node] = kAbsent;
}

bool AdmissionFilter::Contains(NodeIndex node) const {
  if (node < 0 || static_cast<size_t>(node) >= probation_key_.size()) return false;
  return probation_key_[node] != kAbsent || inner_->Contains(node);
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
  size_t held = 0;
  for (NodeIndex node = 0; node < added_below_; ++node) {  // every node ever added
    if (probation_key_[node] == kAbsent) continue;
    ++held;
    if (admitted_[node] != 0 || inner_->Contains(node)) {
      return InvariantViolation("admission: node {} is on probation and admitted", node);
    }
    if (!probation_.contains({probation_key_[node], node})) {
      return InvariantViolation("admission: node {} lost its order", node);
    }
  }
  if (held != probation_.size()) {
    return InvariantViolation("admission: {} nodes keyed, {} on probation", held,
                              probation_.size());
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

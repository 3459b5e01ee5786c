// RunTree: invariants.

#include "kvpool/internal/run_tree.h"
#include "kvpool/internal/tokens.h"
#include "kvpool/util/errors.h"
#include "kvpool/util/status_macros.h"

namespace kvpool::internal {

absl::Status RunTree::CheckInvariants() const {
  int64_t held = 0;
  int64_t runs = 0;
  for (NodeIndex node = 0; node < static_cast<NodeIndex>(nodes_.size()); ++node) {
    const Node& n = nodes_[node];
    const bool root = n.ns != kNoNamespace && n.parent == kNoNode && Root(n.ns) == node;
    if (root && !runs_[node].empty()) return InvariantViolation("root n{} holds blocks", node);
    if (!root && runs_[node].empty()) {  // a free slot
      if (n.parent != kNoNode || n.first_child != kNoNode || n.num_children != 0) {
        return InvariantViolation("free node slot n{} is still linked", node);
      }
      continue;
    }
    KVPOOL_RETURN_IF_ERROR(CheckChildren(node));
    if (root) continue;
    ++runs;
    KVPOOL_RETURN_IF_ERROR(CheckNode(node, &held));
  }
  int64_t placed = 0;
  for (const Place& p : places_) placed += p.node != kNoNode ? 1 : 0;
  if (placed != held) {
    return InvariantViolation("{} blocks have a place, {} are in runs", placed, held);
  }
  if (runs != stats_.runs) return InvariantViolation("{} runs, {} counted", runs, stats_.runs);
  return CheckChains();
}

// One node holding blocks: its place below its parent, its run (every block placed in it at its
// depth, full unless it is a lone partial leaf) and that it is maximal.
absl::Status RunTree::CheckNode(NodeIndex node, int64_t* held) const {
  const Node& n = nodes_[node];
  const NodeIndex parent = n.parent;
  if (parent == kNoNode || parent >= static_cast<NodeIndex>(nodes_.size()) ||
      (runs_[parent].empty() && Root(nodes_[parent].ns) != parent)) {
    return InvariantViolation("node n{} has no live parent", node);
  }
  if (!runs_[parent].empty() && !IsFull(parent)) {
    return InvariantViolation("node n{} hangs under partial node n{}", node, parent);
  }
  if (n.ns != nodes_[parent].ns) return InvariantViolation("node n{} left its namespace", node);
  const int32_t depth0 = runs_[parent].empty() ? 1 : place(runs_[parent].back()).depth + 1;
  if (n.depth0 != depth0) return InvariantViolation("node n{} has a stale depth", node);
  const std::vector<BlockId>& run = runs_[node];
  if (!IsFull(node) && (run.size() != 1 || n.num_children != 0)) {
    return InvariantViolation("partial node n{} is not a lone leaf", node);
  }
  for (size_t i = 0; i < run.size(); ++i) {
    const Place& p = place(run[i]);
    const bool last = i + 1 == run.size();
    if (p.node != node || p.depth != depth0 + static_cast<int32_t>(i)) {
      return InvariantViolation("block {} of node n{} has a stale place", run[i].value(), node);
    }
    if (p.coverage <= 0 || p.coverage > block_size_ ||
        (run.size() > 1 && p.coverage != block_size_)) {
      return InvariantViolation("block {} of node n{} has coverage {}", run[i].value(), node,
                                p.coverage);
    }
    if ((p.leaf != 0) != (last && n.num_children == 0)) {
      return InvariantViolation("block {} of node n{} has a stale leaf mark", run[i].value(), node);
    }
  }
  *held += static_cast<int64_t>(run.size());
  if (n.num_children == 1 && IsFull(n.first_child)) {
    return InvariantViolation("node n{} and its only child n{} are one run, not merged", node,
                              n.first_child);
  }
  if (IsFull(node) && FindFullChild(parent, FirstTokens(node)) == kNoNode) {
    return InvariantViolation("node n{} is not found under its parent", node);
  }
  return absl::OkStatus();
}

absl::Status RunTree::CheckChildren(NodeIndex node) const {
  int32_t children = 0;
  NodeIndex prev = kNoNode;
  for (NodeIndex c = nodes_[node].first_child; c != kNoNode; prev = c, c = nodes_[c].next_sibling) {
    if (nodes_[c].parent != node || nodes_[c].prev_sibling != prev || runs_[c].empty()) {
      return InvariantViolation("node n{} lists child n{} wrongly", node, c);
    }
    if (++children > nodes_[node].num_children) break;
  }
  if (children != nodes_[node].num_children) {
    return InvariantViolation("node n{} child count is stale", node);
  }
  if (nodes_[node].wide != 0 && children == 0) {
    return InvariantViolation("n{} is wide with no child", node);
  }
  if (nodes_[node].wide == 0 && children > kWideFanout) {
    return InvariantViolation("n{} has {} children but is not wide", node, children);
  }
  return absl::OkStatus();
}

// The first-token chains hold exactly the children of wide parents, each under its own key; the
// full-child index only theirs, each under its own token hash.
absl::Status RunTree::CheckChains() const {
  int64_t expected = 0;
  for (NodeIndex node = 0; node < static_cast<NodeIndex>(nodes_.size()); ++node) {
    if (nodes_[node].wide == 0) continue;
    expected += nodes_[node].num_children;
    for (NodeIndex c = nodes_[node].first_child; c != kNoNode; c = nodes_[c].next_sibling) {
      if (IsFull(c) && nodes_[c].token_hash != HashTokens(FirstTokens(c))) {
        return InvariantViolation("full child n{} of wide n{} has a stale token hash", c, node);
      }
    }
  }
  int64_t chained = 0;
  for (const auto& [key, head] : chains_) {
    NodeIndex prev = kNoNode;
    for (NodeIndex n = head; n != kNoNode; prev = n, n = chain_next_[n]) {
      if (nodes_[n].parent != key.parent || nodes_[key.parent].wide == 0 || runs_[n].empty() ||
          FirstTokens(n)[0] != key.token || chain_prev_[n] != prev || ++chained > expected) {
        return InvariantViolation("first-token chain of n{} token {} is broken at n{}", key.parent,
                                  key.token, n);
      }
    }
  }
  if (chained != expected) {
    return InvariantViolation("{} children of wide nodes chained, {} expected", chained, expected);
  }
  for (const auto& [key, child] : children_) {
    if (runs_[child].empty() || nodes_[key.parent].wide == 0 ||
        nodes_[child].parent != key.parent || !IsFull(child) ||
        nodes_[child].token_hash != key.token_hash) {
      return InvariantViolation("child index entry n{} -> n{} is stale", key.parent, child);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvpool::internal
